"""Export a model with an artifact's transforms folded into its weights, as a plain transformers checkpoint.

Engines that quantize the KV cache themselves (vLLM's FP8 cache, llama.cpp's q4_0/q8_0 after conversion) then
cache the transformed keys and values without knowing about kvsqueeze.  The folded checkpoint must compute the
same full-precision logits as the original (checked on a probe text after reloading it with plain
transformers; refused above ``MAX_RELATIVE_ERROR``).  The directory also holds the artifact with its transforms
removed (``kvsqueeze-artifact/``), which kvsqueeze's own cache uses with the folded checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

MAX_RELATIVE_ERROR = 1e-4
EXPORT_FILE = "kvsqueeze_export.json"
ARTIFACT_SUBDIR = "kvsqueeze-artifact"
PROBE_TEXT = ("The tower is 324 metres tall, about the same height as an 81-storey building, and the tallest "
              "structure in Paris. Its base is square, measuring 125 metres on each side.")


def _check_destination(out: Path, overwrite: bool) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ValueError(f"{out} exists and is not empty; pass --overwrite to replace it")


def logits_error(ref: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    """Relative L2 error and max-abs error relative to the largest reference logit."""
    ref, got = ref.double(), got.double()
    return {"relative_l2": float((got - ref).norm() / ref.norm()),
            "max_abs_relative": float((got - ref).abs().max() / ref.abs().max())}


@torch.no_grad()
def export_folded(artifact_path: str | Path, out_dir: str | Path, model_source: str | None = None,
                  overwrite: bool = False, progress: bool = True) -> dict[str, Any]:
    """Fold ``artifact_path``'s transforms into the model and write ``out_dir`` atomically; returns a record."""
    from transformers import AutoModelForCausalLM

    from ..artifact import check_overrides, load_artifact
    from ..atomic_dir import staged_directory
    from ..layout import kv_layout
    from ..models import load_model
    from .fold import fold_transforms

    out = Path(out_dir).expanduser()
    _check_destination(out, overwrite)
    art = load_artifact(artifact_path)
    folded_art = art.with_transforms_folded()  # refuses online key transforms before any work
    keys, values = art.transforms("key"), art.transforms("value")
    if not any(t is not None for t in keys + values):
        raise ValueError(f"artifact {art.name!r} has no transforms to fold (calibrate with --method invertible)")
    model, tok = load_model(model_source, progress=progress)
    check_overrides(art.cache_spec(), kv_layout(model.config))
    ids = tok(PROBE_TEXT, return_tensors="pt").input_ids
    ref = model(input_ids=ids).logits.float()
    # every layer's own RoPE table (partial rotary and per-layer-type tables included) checks its key transform
    fold_transforms(model, keys, values, [art.layer_rope(i)[0] for i in range(len(art.layers))])
    with staged_directory(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        folded_art.save_to(tmp / ARTIFACT_SUBDIR)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=model.dtype)
        reloaded.eval()
        err = logits_error(ref, reloaded(input_ids=ids).logits.float())
        if not err["relative_l2"] <= MAX_RELATIVE_ERROR:
            raise ValueError(f"the folded checkpoint's logits differ from the original by {err['relative_l2']:.3g} "
                             f"(relative L2; limit {MAX_RELATIVE_ERROR:g}): not exported")
        record = {"artifact": art.name, "artifact_path": art.path, "model": model_source or "embedded",
                  "probe_tokens": int(ids.shape[1]), "logits_error": err, "folded_artifact": ARTIFACT_SUBDIR,
                  "method": art.method, "settings": art.settings}
        (tmp / EXPORT_FILE).write_text(json.dumps(record, indent=1, default=str) + "\n")
    record["path"] = str(out)
    return record
