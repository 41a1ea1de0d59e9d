"""vLLM's fp8 KV cache on the original model and on kvsqueeze's exported checkpoints: perplexity, every token's K/V
quantized, the same WikiText-2 chunks for every row.

    PYTHONPATH=src python3 benchmarks/vllm_table.py --export e4m3=DIR --export e5m2=DIR [--chunks 4 --context 1024]

``--build e4m3 e5m2`` first calibrates and exports, per format, the two checkpoints BENCHMARKS.md section 8 uses
(``art-rot-FMT``/``exp-rot-FMT`` with key rotations, ``art-comp-FMT``/``exp-comp-FMT`` without; ``kvsqueeze
calibrate --method vllm-fp8 --samples 4 --length 512 --threads 1`` then ``kvsqueeze export --vllm``) in
``--build-dir``; ``--export`` then names the ones to score.

Rows:

* ``vllm``: vLLM itself through ``prompt_logprobs`` (kvsqueeze's vllm peer, bf16 weights).  vLLM's fp8 cache
  needs AVX-512 or AMX on a CPU (the header prints which this CPU has); where it cannot run, the row says why.
  ``--plugin kivi-4,...``: also vLLM with kvsqueeze's plugin storing those formats in its pages.
* ``emulated``: transformers (fp32 weights) with every layer's K/V passed through vLLM's fp8 conversion
  (:func:`kvsqueeze.calibrate.vllm_fp8.vllm_fp8_dequant`: the truncating conversion of vLLM's CPU kernels, per-layer
  scales; 1.0 without checkpoint scales, as vLLM uses), on the same chunks.

Percentages are against the unquantized cache of the same engine on the original model.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvsqueeze import corpus as corpus_mod
from kvsqueeze.calibrate.export_vllm import reload_plain
from kvsqueeze.calibrate.vllm_fp8 import FP8_MAX, emulated_nll
from kvsqueeze.errors import KvsqueezeError
from kvsqueeze.eval.vllm_peer import VllmPeer, run_ppl
from kvsqueeze.external import vllm_client
from kvsqueeze.models import load_model, set_threads


def _ppl(nll: torch.Tensor) -> float:
    return math.exp(float(nll.double().mean()))


def _naive_scales(model, chunks: torch.Tensor, fmt: str) -> tuple[list[float], list[float]]:
    """absmax / max_fp8 per layer over the evaluation chunks themselves (the issue's naive baseline)."""
    from kvsqueeze.calibrate.collect import collect

    acts = collect(model, chunks[:1], progress=False)
    k = [float(la.k.abs().max()) / FP8_MAX[fmt] for la in acts.layers]
    v = [float(la.v.abs().max()) / FP8_MAX[fmt] for la in acts.layers]
    return k, v


def cpu_fp8_features() -> str:
    """What vLLM's CPU fp8 cache needs (AVX-512 or AMX) as this CPU's flags have it, for the table's header."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1] for ln in info.splitlines() if ln.startswith("flags")), "").split())
    have = sorted(f for f in flags if f == "avx512f" or f.startswith("amx"))
    return f"{name}: " + (", ".join(have) if have else "neither AVX-512 nor AMX (vLLM refuses its fp8 cache)")


def build(fmt: str, folder: Path) -> None:
    """The calibrate + export pair of section 8, for ``fmt`` with key rotations (rot) and without (comp)."""
    for name, extra in (("rot", []), ("comp", ["--no-key-rotation"])):
        art, exp = folder / f"art-{name}-{fmt}", folder / f"exp-{name}-{fmt}"
        for cmd in (["calibrate", "--method", "vllm-fp8", "--fp8-format", fmt, *extra, "--out", str(art), "--samples",
                     "4", "--length", "512", "--threads", "1"], ["export", "--kv", str(art), "--vllm", str(exp)]):
            print("vllm_table: kvsqueeze " + " ".join(cmd), file=sys.stderr, flush=True)
            subprocess.run([sys.executable, "-m", "kvsqueeze.cli", *cmd], check=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--export", action="append", default=[], metavar="FMT=DIR",
                   help="an exported checkpoint (kvsqueeze export --vllm) and the fp8 format it was calibrated for")
    p.add_argument("--unquantized", action="append", default=[], metavar="DIR",
                   help="also score this exported checkpoint with an unquantized cache (emulated rows)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-vllm", action="store_true", help="emulated rows only")
    p.add_argument("--no-emulated", action="store_true", help="vLLM rows only")
    p.add_argument("--plugin", default="", metavar="FMT,...",
                   help="also vLLM with kvsqueeze's plugin storing these formats (kivi-4, kivi-2, int8) on the "
                        "original model (vllm:kvsqueeze-FMT; the plugin installed beside vLLM)")
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    p.add_argument("--build", nargs="+", default=[], choices=sorted(FP8_MAX), metavar="FMT",
                   help="calibrate and export exp-rot-FMT and exp-comp-FMT first (the loop of BENCHMARKS.md section 8)")
    p.add_argument("--build-dir", default=".", help="where --build writes its artifacts and exports")
    args = p.parse_args()
    for fmt in args.build:
        build(fmt, Path(args.build_dir))
    exports = []  # (label, fmt, path)
    for item in args.export:
        fmt, _, path = item.partition("=")
        if fmt not in FP8_MAX or not Path(path, "kvsqueeze_export.json").is_file():
            raise SystemExit(f"--export takes e4m3=DIR or e5m2=DIR with an exported checkpoint, got {item!r}")
        st = json.loads(Path(path, "kvsqueeze_export.json").read_text())["settings"]
        parts = [p for p, on in (("compensated", st.get("compensate")), ("key rotations", st.get("rotate_keys")))
                 if on]
        exports.append((f"export {fmt} ({' + '.join(parts) or 'scales only'})", fmt, Path(path)))
    threads = set_threads(args.threads)
    model, tok = load_model(progress=False)
    ids = corpus_mod.tokenize(corpus_mod.resolve_corpus(None, "wikitext2"), tok)
    chunks = corpus_mod.eval_chunks(ids, args.context, args.chunks)
    rows = []

    def add(engine: str, model_name: str, cache: str, ppl: float | None, note: str = "") -> None:
        rows.append({"engine": engine, "model": model_name, "cache": cache, "ppl": ppl, "note": note})
        print(f"  {engine:9s} {model_name:44s} {cache:30s} {'' if ppl is None else f'{ppl:.3f}'} {note}",
              file=sys.stderr, flush=True)

    print(f"vllm_table: {args.chunks} x {args.context} WikiText-2 tokens, {threads} threads; CPU "
          f"{cpu_fp8_features()}", file=sys.stderr)
    # ---- vLLM itself
    if not args.no_vllm and vllm_client.vllm_python() is not None:
        targets = [("original", None, d) for d in ("auto", "fp8_e4m3", "fp8_e5m2")]
        targets += [(label, str(path), f"fp8_{fmt}") for label, fmt, path in exports]
        targets += [("original", None, f"kvsqueeze-{f}") for f in args.plugin.split(",") if f]
        no_fp8 = ""  # vLLM's reason for refusing fp8 on this CPU, once known
        for name, source, dtype in targets:
            cache = (f"{dtype} (plugin; kv_cache_dtype=auto)" if dtype.startswith("kvsqueeze-")
                     else f"kv_cache_dtype={dtype}")
            if no_fp8 and dtype.startswith("fp8"):
                add("vllm", name, cache, None, f"not run: {no_fp8}")
                continue
            try:
                r = run_ppl(VllmPeer(dtype), chunks, source, threads)
                add("vllm", name, cache, r["ppl"], r["engine"])
            except KvsqueezeError as exc:
                reason = str(exc).split(" (log:")[0].split("task: ")[-1]
                if "AVX-512" in reason:
                    no_fp8 = "vLLM's fp8 cache cannot run on this CPU: " + reason.split("on this CPU: ")[-1]
                    if getattr(exc, "log", None) is not None:
                        exc.log.unlink(missing_ok=True)
                add("vllm", name, cache, None, f"not run: {reason}")
    elif not args.no_vllm:
        add("vllm", "-", "-", None, "vLLM is not installed (README: vLLM)")
    # ---- emulation of vLLM's CPU fp8 cache in transformers
    if not args.no_emulated:
        with torch.no_grad():
            t = time.perf_counter()
            add("emulated", "original", "unquantized", _ppl(emulated_nll(model, chunks, None)))
            for fmt in ("e4m3", "e5m2"):
                add("emulated", "original", f"fp8_{fmt}, scales 1.0",
                    _ppl(emulated_nll(model, chunks, fmt)))
            k, v = _naive_scales(model, chunks, "e4m3")
            add("emulated", "original", "fp8_e4m3, absmax/448 scales (chunk 1)", _ppl(emulated_nll(model, chunks, "e4m3", k, v)))
            for label, fmt, path in exports:
                rec = json.loads((path / "kvsqueeze_export.json").read_text())
                exported = reload_plain(path, torch.float32)
                add("emulated", label, f"fp8_{fmt}, calibrated scales",
                    _ppl(emulated_nll(exported, chunks, fmt, rec["k_scale"], rec["v_scale"])))
                if any(Path(u).resolve() == path.resolve() for u in args.unquantized):
                    add("emulated", label, "unquantized", _ppl(emulated_nll(exported, chunks, None)))
                del exported
            print(f"  emulated rows: {time.perf_counter() - t:.0f} s", file=sys.stderr)
    # ---- the table
    base = {r["engine"]: r["ppl"] for r in rows if r["model"] == "original" and r["cache"] in
            ("unquantized", "kv_cache_dtype=auto") and r["ppl"]}
    print(f"| engine | model | KV cache | ppl | vs {' / '.join(f'{e} unquantized' for e in base)} | note |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        b = base.get(r["engine"])
        rel = f"{100 * (r['ppl'] / b - 1):+.2f}%" if (b and r["ppl"]) else ""
        ppl = "" if r["ppl"] is None else f"{r['ppl']:.3f}"
        print(f"| {r['engine']} | {r['model']} | {r['cache']} | {ppl} | {rel} | {r['note']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "chunks": args.chunks, "context": args.context,
                                               "threads": threads}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
