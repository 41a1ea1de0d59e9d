"""Fingerprint every cache path: SHA-256 of the logits each preset and calibrated method produces.

Used to show that a refactor changes no output bit: run it before, save the JSON, run it after with
``--compare``.  What is fingerprinted (fixed inputs, 2 threads):

* the embedded SmolLM2-135M on the first WikiText-2 test tokens: every preset, backends ``torch`` (reference)
  and ``auto`` (the C++ kernel on CPU), a 320-token prompt then 48 teacher-forced decode steps (logits of every
  step), and the cache's exact byte counts; plus the window and all-quantized perplexity protocols on 512 tokens;
* a random tiny Llama: SKVQ, KVQuant-style (hybrid, non-uniform) and learned invertible artifacts calibrated on
  random ids (the artifact tensors are hashed too), then used as caches the same way.

    python benchmarks/cache_fingerprint.py --out before.json
    python benchmarks/cache_fingerprint.py --out after.json --compare before.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _run_cache(model, ids: torch.Tensor, cache, prompt: int) -> tuple[str, dict]:
    from kvsqueeze.adapter import cache_kwargs

    outs = []
    with torch.no_grad():
        out = model(ids[:, :prompt], **cache_kwargs(model, cache), use_cache=True)
        outs.append(out.logits[:, -1])
        for t in range(prompt, ids.shape[1]):
            out = model(ids[:, t:t + 1], **cache_kwargs(model, cache), use_cache=True)
            outs.append(out.logits[:, -1])
    nb = cache.nbytes()
    return _digest(torch.stack(outs)), {"codes": nb.codes, "params": nb.params, "fp": nb.full_precision}


def _wikitext_ids(tok, n: int) -> torch.Tensor:
    root = Path(os.environ.get("KVSQUEEZE_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
    text = (root / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")[:20000]
    return tok(text, return_tensors="pt").input_ids[:, :n]


def embedded_prints() -> dict[str, str]:
    import kvsqueeze
    from kvsqueeze.eval.protocols import nll_all_quantized, nll_window

    model, tok = kvsqueeze.load_model()
    ids = _wikitext_ids(tok, 368)
    long_ids = _wikitext_ids(tok, 512)
    out: dict[str, str] = {}
    for name in kvsqueeze.PRESETS:
        for backend in ("torch", "auto"):
            cache = kvsqueeze.QuantizedCache(model.config, name, backend=backend)
            digest, nb = _run_cache(model, ids, cache, 320)
            out[f"embedded/{name}/{backend}"] = digest
            out[f"embedded/{name}/bytes"] = json.dumps(nb)
            print(f"{name:14s} {backend:6s} {digest}", file=sys.stderr)
        spec = kvsqueeze.PRESETS[name]
        with torch.no_grad():
            out[f"embedded/{name}/protocol-window"] = _digest(nll_window(model, long_ids, spec))
            out[f"embedded/{name}/protocol-all"] = _digest(nll_all_quantized(model, long_ids, spec))
    return out


def tiny_prints(workdir: Path) -> dict[str, str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    import kvsqueeze
    from kvsqueeze.calibrate import CalibrationSettings, calibrate
    from kvsqueeze.calibrate.collect import CalibrationData

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval().requires_grad_(False)
    calib = torch.randint(2, 256, (2, 96), generator=torch.Generator().manual_seed(1))
    ids = torch.randint(2, 256, (1, 200), generator=torch.Generator().manual_seed(2))
    settings = {
        "skvq": CalibrationSettings(method="skvq", window=16, sinks=2),
        "hybrid-nuq": CalibrationSettings(method="hybrid", nuq=True, window=16, sinks=2, clip="group"),
        "kvquant": CalibrationSettings(method="kvquant", window=16, sinks=2),
        "invertible-folded": CalibrationSettings(method="invertible", key_bits=2, value_bits=2, window=32, sinks=2,
                                                 steps=5, grouping="kivi", key_group=32, value_group=32),
        "invertible-online": CalibrationSettings(method="invertible", key_bits=2, value_bits=1.5, window=16,
                                                 sinks=2, steps=5, transform="learned-online", grouping="skvq"),
    }
    out: dict[str, str] = {}
    for name, s in settings.items():
        art = calibrate(model, CalibrationData(calib, {"source": "random ids (fingerprint)"}), s, "tiny",
                        progress=False)
        path = art.save(workdir / name)
        tensors = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix != ".json")
        out[f"tiny/{name}/artifact"] = hashlib.sha256(b"".join(p.read_bytes() for p in tensors)).hexdigest()[:16]
        for backend in ("torch", "auto"):
            cache = kvsqueeze.QuantizedCache(model.config, str(path), backend=backend)
            digest, nb = _run_cache(model, ids, cache, 120)
            out[f"tiny/{name}/{backend}"] = digest
            out[f"tiny/{name}/bytes"] = json.dumps(nb)
            print(f"{name:18s} {backend:6s} {digest}", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="-", help="JSON file for the fingerprints ('-' = stdout)")
    ap.add_argument("--compare", help="an earlier --out file: print every entry that differs, exit 1 if any")
    ap.add_argument("--skip-embedded", action="store_true", help="only the tiny calibrated models")
    args = ap.parse_args()
    torch.set_num_threads(2)
    prints: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        prints.update(tiny_prints(Path(tmp)))
    if not args.skip_embedded:
        prints.update(embedded_prints())
    text = json.dumps(prints, indent=1, sort_keys=True)
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text + "\n")
    if args.compare:
        old = json.loads(Path(args.compare).read_text())
        diff = [k for k in sorted(set(old) | set(prints)) if old.get(k) != prints.get(k)]
        for k in diff:
            print(f"DIFFERS {k}: {old.get(k)} -> {prints.get(k)}")
        print(f"{len(prints) - len(diff)} of {len(prints)} fingerprints identical")
        sys.exit(1 if diff else 0)


if __name__ == "__main__":
    main()
