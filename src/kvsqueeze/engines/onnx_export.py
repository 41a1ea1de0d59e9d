"""Export a model's static prefill and decode steps to ONNX, with metadata that ties the graphs to the model.

Both graphs carry ``kvsqueeze.*`` metadata (model fingerprint, S, batch, layout, KV format, shapes and the
digest of the fixed quantization parameters), so a runner can refuse graphs made for another model or another
shape before running anything.  The TorchScript-based exporter (``dynamo=False``) is used: it works offline
with torch 2.13 and needs no onnxscript; opset 17.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..atomic_dir import staged_directory
from .static_manager import LAYOUTS, StaticKVQuant

if TYPE_CHECKING:  # torch is imported where it is used, so a runner importing this module stays torch-free
    import torch

    from .static_step import StaticStep

FORMAT_VERSION = "2"  # 2: weights in a shared external-data file
OPSET = 17
PREFILL_FILE, DECODE_FILE, QUANT_FILE, META_FILE = "prefill.onnx", "decode.onnx", "kv_quant.npz", "meta.json"
WEIGHTS_FILE = "weights.bin"  # the weights of both graphs, stored once
_EXTERNAL_MIN_BYTES = 1024  # smaller constants stay inside the graph
_ALIGN = 4096  # page-aligned tensors, so they can be memory-mapped in place
KV_FORMATS = ("float", "int8-static", "int4-static")


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of the config and a sample of the weights: same model, same fingerprint."""
    import torch

    cfg = model.config.to_dict()
    cfg.pop("transformers_version", None)
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
    inner = model.model
    samples = [inner.embed_tokens.weight[:8], inner.norm.weight, model.lm_head.weight[-8:]]
    for layer in inner.layers:
        samples += [layer.input_layernorm.weight, layer.self_attn.k_proj.weight[:2]]
    for t in samples:
        h.update(t.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def kv_format(quant: StaticKVQuant | None) -> str:
    return "float" if quant is None else f"int{quant.bits}-static"


def io_names(n_layers: int, mode: str) -> tuple[list[str], list[str]]:
    """Graph input and output names (one past/new K and V tensor per layer)."""
    inputs = ["input_ids", "attention_mask", "position_ids"]
    if mode == "decode":
        inputs += [f"past_{kv}_{i}" for i in range(n_layers) for kv in ("key", "value")]
    prefix = "new" if mode == "decode" else "key_value"
    outputs = ["logits"] + [f"{prefix}_{kv}_{i}" for i in range(n_layers) for kv in ("key", "value")]
    return inputs, outputs


def default_onnx_dir(fingerprint: str, max_len: int, kv: str, *, batch_size: int = 1,
                     layout: str = "token") -> Path:
    """``$KVSQUEEZE_CACHE/onnx/<fingerprint>-<S>-<kv>`` (default root ``~/.cache/kvsqueeze``); a non-default
    batch or layout is added to the name."""
    root = os.environ.get("KVSQUEEZE_CACHE") or str(Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "kvsqueeze")
    name = f"{fingerprint}-{max_len}-{kv}" + (f"-b{batch_size}" if batch_size != 1 else "")
    name += "" if layout == "token" else f"-{layout}"
    return Path(root).expanduser() / "onnx" / name


def export_static_graphs(
    model: torch.nn.Module,
    out_dir: str | Path,
    max_len: int,
    *,
    quant: StaticKVQuant | None = None,
    layout: str = "token",
    batch_size: int = 1,
    extra_meta: dict[str, str] | None = None,
) -> Path:
    """Write ``prefill.onnx``, ``decode.onnx``, ``weights.bin``, ``meta.json`` (and ``kv_quant.npz`` when
    quantized) into ``out_dir``.  Both graphs keep their weights in ``weights.bin`` as ONNX external data, each
    distinct tensor once, so a runner can map one copy and share it between the two sessions.  ``meta.json``
    repeats the graphs' metadata for a quick look; runners trust the graphs only.

    The folder is filled in a temporary sibling and renamed into place, so it is either complete or absent.
    """
    import onnx

    from .static_step import StaticStep

    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; allowed: {', '.join(LAYOUTS)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    out = Path(out_dir).expanduser()
    steps = {m: StaticStep(model, max_len, m, layout=layout, quant=quant).eval() for m in ("prefill", "decode")}
    meta = graph_metadata(model, steps["decode"], batch_size, extra_meta)
    with staged_directory(out) as tmp:
        stored: dict[str, int] = {}
        with open(tmp / WEIGHTS_FILE, "wb") as weights:
            for mode, step in steps.items():
                path = tmp / (PREFILL_FILE if mode == "prefill" else DECODE_FILE)
                _export_one(step, example_inputs(step, batch_size), path, mode)
                proto = onnx.load(str(path))
                onnx.helper.set_model_props(proto, {**meta, "kvsqueeze.mode": mode})
                _externalize(proto, weights, stored)
                onnx.save(proto, str(path))
        if quant is not None:
            quant.save(tmp / QUANT_FILE)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
    return out


def _externalize(proto, weights, stored: dict[str, int]) -> None:
    """Move the graph's large initializers to ``weights`` (deduplicated by content across graphs: the exporter
    names the same folded weight differently in each graph)."""
    import onnx
    from onnx.external_data_helper import set_external_data

    for init in proto.graph.initializer:
        raw = init.raw_data
        if len(raw) < _EXTERNAL_MIN_BYTES:
            continue
        key = f"{init.data_type}:{list(init.dims)}:{hashlib.sha256(raw).hexdigest()}"
        if key not in stored:
            weights.write(b"\0" * (-weights.tell() % _ALIGN))
            stored[key] = weights.tell()
            weights.write(raw)
        set_external_data(init, location=WEIGHTS_FILE, offset=stored[key], length=len(raw))
        init.ClearField("raw_data")
        init.data_location = onnx.TensorProto.EXTERNAL


def graph_metadata(model: torch.nn.Module, step: StaticStep, batch_size: int,
                   extra: dict[str, str] | None = None) -> dict[str, str]:
    quant = step.quant
    meta = {
        "kvsqueeze.format": FORMAT_VERSION,
        "kvsqueeze.fingerprint": model_fingerprint(model),
        "kvsqueeze.model_type": str(model.config.model_type),
        "kvsqueeze.max_len": str(step.window + 1),
        "kvsqueeze.batch_size": str(batch_size),
        "kvsqueeze.layout": step.layout,
        "kvsqueeze.kv": kv_format(quant),
        "kvsqueeze.n_layers": str(step.n_layers),
        "kvsqueeze.n_kv_heads": str(step.n_kv),
        "kvsqueeze.head_dim": str(step.head_dim),
        "kvsqueeze.stored_dim": str(quant.stored_dim(step.head_dim) if quant else step.head_dim),
        "kvsqueeze.kv_dtype": str(quant.storage_dtype) if quant else "float32",
        "kvsqueeze.vocab_size": str(model.config.vocab_size),
        "kvsqueeze.quant_digest": quant.digest() if quant else "",
    }
    meta.update({f"kvsqueeze.{k}": str(v) for k, v in (extra or {}).items()})
    return meta


def example_inputs(step: StaticStep, batch_size: int) -> tuple[torch.Tensor, ...]:
    """Inputs of the right static shapes and dtypes (a one-token prompt at the right edge of the window)."""
    import torch

    w, b = step.window, batch_size
    if step.mode == "prefill":
        mask = torch.zeros(b, w, dtype=torch.long)
        mask[:, -1] = 1
        return torch.zeros(b, w, dtype=torch.long), mask, torch.zeros(b, w, dtype=torch.long)
    mask = torch.zeros(b, w + 1, dtype=torch.long)
    mask[:, -2:] = 1
    d = step.quant.stored_dim(step.head_dim) if step.quant else step.head_dim
    shape = (w, b, step.n_kv, d) if step.layout == "token" else (b, step.n_kv, w, d)
    dtype = torch.float32 if step.quant is None else (
        torch.int8 if step.quant.storage_dtype.kind == "i" else torch.uint8)
    past = [torch.zeros(shape, dtype=dtype) for _ in range(2 * step.n_layers)]
    return (torch.zeros(b, 1, dtype=torch.long), mask, torch.ones(b, 1, dtype=torch.long), *past)


def _export_one(step: StaticStep, args: tuple[torch.Tensor, ...], path: Path, mode: str) -> None:
    import torch

    inputs, outputs = io_names(step.n_layers, mode)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
        torch.onnx.export(step, args, str(path), input_names=inputs, output_names=outputs, opset_version=OPSET,
                          dynamo=False, do_constant_folding=True)


def read_meta_json(out_dir: str | Path) -> dict[str, Any] | None:
    """The ``meta.json`` of an export folder, or None when there is no complete export there."""
    folder = Path(out_dir).expanduser()
    if not all((folder / f).is_file() for f in (PREFILL_FILE, DECODE_FILE, META_FILE, WEIGHTS_FILE)):
        return None
    try:
        return json.loads((folder / META_FILE).read_text())
    except (OSError, ValueError):
        return None
