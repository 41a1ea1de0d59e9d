"""Export for vLLM: a checkpoint vLLM loads unchanged, with calibrated fp8 KV scales
(``kvsqueeze export --kv ARTIFACT --vllm OUT_DIR``).

The directory is a plain Hugging Face checkpoint plus a compressed-tensors ``quantization_config`` whose only
entry is a ``kv_cache_scheme`` (fp8, one scale per layer: what vLLM's CPU path accepts), and the scalar tensors
``model.layers.N.self_attn.k_scale`` / ``v_scale``.  What the artifact can fold goes into the weights:

* its transforms (RoPE-commuting key transforms before RoPE, general value transforms into W_v / W_o;
  :func:`kvsqueeze.calibrate.fold.fold_transforms`) - exact, they leave the full-precision function unchanged;
* ``vllm-fp8`` compensations of the fp8 conversion's bias: ``W_q`` rows of the query heads of KV head h times
  ``c_k[h]``, ``o_proj`` input columns times ``c_v[h]``.  These are made for the quantized cache: with an
  unquantized cache the logits move (the record states by how much).

The export reloads the checkpoint with plain transformers (the quantization entry aside) and refuses it unless
the logits equal the folded model's; a ``check`` callback (the command passes a vLLM load) runs on the staged
directory before it is moved into place, so a failure leaves nothing behind.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .export import EXPORT_FILE, MAX_RELATIVE_ERROR, PROBE_TEXT, _check_destination, logits_error

KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def vllm_representable(art: Any) -> None:
    """ValueError naming the first layer and side vLLM's fp8 cache cannot store as the artifact says."""
    for i, lay in enumerate(art.layers):
        for name in ("key", "value"):
            q = lay[name].quant
            if not q.quantized:
                continue
            if not q.fmt.startswith("fp8"):
                axis = "per-channel (pre-RoPE)" if lay[name].kind == "prerope" else f"per-{q.axis}"
                layout = f"{q.bits}-bit integer codes, {axis} groups" if q.fmt == "int" else q.fmt
                raise ValueError(f"vLLM cannot represent artifact {art.name!r}: layer {i} {name}s are {layout}; "
                                 f"vLLM's KV cache stores fp8 with one scale per layer (calibrate with --method "
                                 f"vllm-fp8)")
            if lay[name].kind != "plain" or "vllm_scale" not in lay[name].tensors:
                raise ValueError(f"artifact {art.name!r}, layer {i} {name}s: fp8 without a calibrated per-layer "
                                 f"scale (calibrate with --method vllm-fp8)")


def scales(art: Any, side: str) -> list[float]:
    return [float(lay[side].tensors["vllm_scale"]) if "vllm_scale" in lay[side].tensors else 1.0
            for lay in art.layers]


@torch.no_grad()
def fold_compensation(model: Any, art: Any) -> None:
    """Multiply W_q rows by c_k and the o_proj input columns by c_v, per KV head of each layer, in place."""
    from .fold import _attn_modules

    mods = _attn_modules(model)
    for mod, lay in zip(mods, art.layers):
        ck, cv = lay["key"].tensors.get("compensation"), lay["value"].tensors.get("compensation")
        if ck is not None:
            hkv = ck.numel()
            w = mod.q_proj.weight
            hq_rows = w.shape[0] // hkv  # rows of the query heads sharing KV head h
            w.mul_(ck.double().repeat_interleave(hq_rows).to(w.dtype)[:, None])
            if mod.q_proj.bias is not None:
                mod.q_proj.bias.mul_(ck.double().repeat_interleave(hq_rows).to(w.dtype))
        if cv is not None:
            hkv = cv.numel()
            w = mod.o_proj.weight
            cols = w.shape[1] // hkv
            w.mul_(cv.double().repeat_interleave(cols).to(w.dtype)[None, :])


def _save_with_scales(model: Any, tok: Any, out: Path, k: list[float], v: list[float], art: Any) -> None:
    from safetensors.torch import load_file, save_file

    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    files = sorted(out.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"expected one safetensors file in the saved checkpoint, found {len(files)}")
    tensors = load_file(str(files[0]))
    for i, (ks, vs) in enumerate(zip(k, v)):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(ks, dtype=torch.float32)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(vs, dtype=torch.float32)
    save_file(tensors, str(files[0]), metadata={"format": "pt"})
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "dense", "quantization_status": "frozen",
        "config_groups": {}, "ignore": [], "kv_cache_scheme": dict(KV_SCHEME),
        "kvsqueeze": {"artifact": art.name, "fp8_format": _fmt(art), "serve_with": f"--kv-cache-dtype fp8_{_fmt(art)}"},
    }
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def _fmt(art: Any) -> str:
    for lay in art.layers:
        q = lay["key"].quant
        if q.fmt.startswith("fp8"):
            return q.fmt.removeprefix("fp8-")
    return "e4m3"


def reload_plain(path: Path, dtype: torch.dtype) -> Any:
    """The checkpoint as kvsqueeze's own commands load it (``ppl --model OUT``): plain transformers, the
    KV-scales-only compressed-tensors entry set aside (one loader, so the export checks what evaluation loads)."""
    from ..models import load_causal_lm

    return load_causal_lm(path, dtype).eval()


@torch.no_grad()
def export_vllm(artifact_path: str | Path, out_dir: str | Path, model_source: str | None = None,
                overwrite: bool = False, progress: bool = True,
                check: Callable[[Path, list[int]], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Fold ``artifact_path`` into the model and write a vLLM checkpoint at ``out_dir``; returns a record."""
    from ..artifact import check_overrides, load_artifact
    from ..atomic_dir import staged_directory
    from ..layout import kv_layout
    from ..models import load_model
    from .fold import fold_transforms

    out = Path(out_dir).expanduser()
    _check_destination(out, overwrite)
    art = load_artifact(artifact_path)
    vllm_representable(art)
    art.with_transforms_folded()  # refuses online key transforms before any work
    keys, values = art.transforms("key"), art.transforms("value")
    model, tok = load_model(model_source, progress=progress)
    check_overrides(art.cache_spec(), kv_layout(model.config))
    ids = tok(PROBE_TEXT, return_tensors="pt").input_ids
    original = model(input_ids=ids).logits.float()
    if any(t is not None for t in keys + values):
        fold_transforms(model, keys, values, art.rope["inv_freq"])
    fold_compensation(model, art)
    folded = model(input_ids=ids).logits.float()
    k, v = scales(art, "key"), scales(art, "value")
    with staged_directory(out) as tmp:
        _save_with_scales(model, tok, tmp, k, v, art)
        err = logits_error(folded, reload_plain(tmp, model.dtype)(input_ids=ids).logits.float())
        if not err["relative_l2"] <= MAX_RELATIVE_ERROR:
            raise ValueError(f"the exported checkpoint's logits differ from the folded model's by "
                             f"{err['relative_l2']:.3g} (relative L2; limit {MAX_RELATIVE_ERROR:g}): not exported")
        record = {"artifact": art.name, "artifact_path": art.path, "model": model_source or "embedded",
                  "probe_tokens": int(ids.shape[1]), "logits_error": err,
                  "unquantized_change": logits_error(original, folded),
                  "fp8_format": _fmt(art), "kv_cache_scheme": KV_SCHEME, "k_scale": k, "v_scale": v,
                  "method": art.method, "settings": art.settings}
        if check is not None:
            record["vllm_check"] = check(tmp, ids[0].tolist())
        (tmp / EXPORT_FILE).write_text(json.dumps(record, indent=1, default=str) + "\n")
    record["path"] = str(out)
    return record
