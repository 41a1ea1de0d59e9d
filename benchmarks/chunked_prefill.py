"""Chunked prefill vs one pass: what feeding a long prompt in chunks over a packed history costs on CPU.

One process, the embedded model (SmolLM2-135M), a prompt of random token ids (seeded), batch 1.  Timed runs:

  (a) one pass, cache "full"               (prompt attention: torch SDPA over exact K/V)
  (b) one pass, cache SPEC                  (the same attention; the prompt's K/V quantized as it is stored)
  (c) chunks of CHUNK, SPEC, backend "cpu"  (each chunk attends over the packed history: the C++ multi-query kernel)
  (d) chunks of CHUNK, SPEC, backend "torch" (the same through the block-by-block reference)

Each run is a fresh ``QuantizedCache`` and forward passes with ``logits_to_keep=1`` (only the last position's logits,
as ``generate`` does for a prompt), so the figure is the prefill alone.  With ``--repeats N`` the runs are
interleaved N times and the median is printed.  Ratios are to (a) from the same process; the load average is
printed before and after, since the timings are only comparable within one run.

    PYTHONPATH=src python benchmarks/chunked_prefill.py --tokens 8000 --chunk 1024 --threads 1
    PYTHONPATH=src python benchmarks/chunked_prefill.py --kernel-history 3072 --chunk 1024 --threads 1  # kernel only
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def prefill_seconds(model, ids: torch.Tensor, spec: str, backend: str, chunk: int) -> float:
    from kvsqueeze import QuantizedCache, cache_kwargs

    cache = QuantizedCache(model.config, spec, backend=backend)
    start = time.perf_counter()
    with torch.no_grad():
        for s in range(0, ids.shape[1], chunk):
            model(input_ids=ids[:, s:s + chunk], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start


def kernel_comparison(history: int, chunk: int, spec: str, repeats: int) -> None:
    """One layer's attention for one chunk alone: ``chunk`` queries (SmolLM2 heads: 3 KV heads, 9 query heads,
    head_dim 64) over ``history`` packed tokens and themselves, causal bool mask as transformers passes it: torch
    SDPA over the same tokens held exact, the C++ multi-query kernel, the block-by-block reference (best of N)."""
    from kvsqueeze.cache.layer import LayerKV
    from kvsqueeze.kernels import cpu, reference
    from kvsqueeze.spec import preset

    g = torch.Generator().manual_seed(1)
    k = torch.randn(1, 3, history + chunk, 64, generator=g) * 1.5 + 0.3
    v = torch.randn(1, 3, history + chunk, 64, generator=g)
    q = torch.randn(1, 9, chunk, 64, generator=g)
    layer = LayerKV(preset(spec))
    layer.stage(k[:, :, :history], v[:, :, :history])
    layer.commit()
    layer.stage(k[:, :, history:], v[:, :, history:])
    plan = layer.plan()
    cols = torch.arange(history + chunk)
    mask = (cols[None, :] <= (torch.arange(chunk) + history)[:, None])[None, None]
    methods = {
        "torch SDPA, exact K/V": lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True),
        f"C++ multi-query kernel, {spec}": lambda: cpu.attend(q, plan, mask, 0.125),
        f"reference, {spec}": lambda: reference.attend(q, plan, mask, 0.125),
    }
    best = {}
    for name, fn in methods.items():
        fn()
        best[name] = min(_timed(fn) for _ in range(repeats))
    base = best["torch SDPA, exact K/V"]
    print(f"\n# one layer, one chunk: {chunk} queries over {history} stored tokens + themselves, "
          f"{torch.get_num_threads()} thread(s), best of {repeats}")
    print("| method | ms | vs SDPA |")
    print("|---|---|---|")
    for name, t in best.items():
        print(f"| {name} | {t * 1e3:.0f} | {t / base:.2f}x |")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8000, help="prompt length")
    ap.add_argument("--chunk", type=int, default=1024, help="tokens per chunk for (c) and (d)")
    ap.add_argument("--spec", default="kivi-2", help="quantized cache preset or spec for (b)-(d)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved repetitions (median printed)")
    ap.add_argument("--skip-reference", action="store_true", help="leave out (d), the slowest run")
    ap.add_argument("--kernel-history", type=int, default=0,
                    help="only time one layer's attention for one chunk over this many stored tokens (0: off)")
    args = ap.parse_args()
    if args.tokens < 1 or args.chunk < 1 or args.threads < 1 or args.repeats < 1 or args.kernel_history < 0:
        ap.error("--tokens, --chunk, --threads and --repeats must be positive, --kernel-history >= 0")
    from kvsqueeze.eval.benchkit import load, set_threads

    set_threads(args.threads)
    if args.kernel_history:
        kernel_comparison(args.kernel_history, args.chunk, args.spec, max(args.repeats, 3))
        return

    from kvsqueeze.kernels import cpu

    model, _, _ = load(args)
    ids = torch.randint(100, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    runs = [("a", "one pass", "full", "cpu", args.tokens), ("b", "one pass", args.spec, "cpu", args.tokens),
            ("c", f"chunks of {args.chunk}", args.spec, "cpu", args.chunk)]
    if not args.skip_reference:
        runs.append(("d", f"chunks of {args.chunk}", args.spec, "torch", args.chunk))
    # warm-up: builds or loads the C++ extension and touches every code path once on a short prompt
    for _, _, spec, backend, chunk in runs:
        prefill_seconds(model, ids[:, :min(args.tokens, 600)], spec, backend, min(chunk, 300))

    print(f"# chunked prefill: {args.tokens}-token prompt (random ids), batch 1, embedded SmolLM2-135M, float32, "
          f"{torch.get_num_threads()} thread(s), C++ kernel {'built' if cpu.available() else 'UNAVAILABLE'}; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    times: dict[str, list[float]] = {r[0]: [] for r in runs}
    for _ in range(args.repeats):
        for key, _, spec, backend, chunk in runs:
            times[key].append(prefill_seconds(model, ids, spec, backend, chunk))
    base = statistics.median(times["a"])
    print("| run | prompt | cache | backend | seconds | vs (a) |")
    print("|---|---|---|---|---|---|")
    for key, how, spec, backend, _ in runs:
        t = statistics.median(times[key])
        print(f"| ({key}) | {how} | {spec} | {backend} | {t:.1f} | {t / base:.2f}x |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
