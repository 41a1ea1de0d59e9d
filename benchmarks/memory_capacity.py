"""Peak memory of a long prompt beside the cache's bytes, and the capacity of a memory budget, per cache.

Every measurement is one ``kvsqueeze speed ... --json -`` run in a fresh process (so one run's allocations cannot
hide or inflate another's peak): a random prompt prefilled (``--prefill-chunk``, 0 = one pass), a few decode
steps, peak RSS growth over the run (the kernel's high-water mark, reset first) and the cache's exact bytes.

* ``--long N`` (default 8000): batch 1 x N for each cache, chunked and one pass: peak growth - cache bytes is what
  the prompt costs beside the cache; prefill seconds beside ``full``'s of the same run.
* ``--batch-run B`` (default 4 x 4096): the same at batch B.
* capacity in ``--budget`` (default 2GiB): from a batch 1 x 4096 run per cache (its peak beyond the cache, per
  sequence) and the cache's exact bytes at two lengths (``kvsqueeze.eval.capacity``): the longest context (batch 1)
  and the largest batch of 4096-token sequences; the batch run checks the projection against a measured peak.

    KVSQUEEZE_DATA=../shared/data python benchmarks/memory_capacity.py --threads 2 --out bench/memory
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CACHES = ("full", "kivi-4", "kivi-2", "hf-dynamic", "hf-quanto-int4", "hf-quanto-int2")
MIB = 2**20


def speed(kv: str, context: int, batch: int, chunk: int, threads: int, budget: str | None, decode: int = 4) -> dict:
    cmd = [sys.executable, "-m", "kvsqueeze.cli", "speed", "--kv", kv, "--context", str(context), "--batch",
           str(batch), "--decode-tokens", str(decode), "--prefill-chunk", str(chunk), "--threads", str(threads),
           "--json", "-"] + (["--budget", budget] if budget else [])
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{out.stderr[-2000:]}")
    rec = json.loads(out.stdout)
    print(f"  {kv} batch {batch} x {context}, chunk {chunk or 'one pass'}: peak +{rec['peak_rss_delta_bytes'] / MIB:.0f}"
          f" MiB, cache {rec['kv_bytes']['total'] / MIB:.1f} MiB, prefill {rec['prefill_s']:.1f} s "
          f"({time.perf_counter() - t:.0f} s)", file=sys.stderr, flush=True)
    return rec


def row(rec: dict, base: dict | None) -> str:
    kv = rec["kv_bytes"]["total"]
    over = rec["peak_rss_delta_bytes"] - kv
    ratio = f"{rec['prefill_s'] / base['prefill_s']:.2f}" if base else "-"
    return (f"| {rec['kv']} | {rec['batch']} x {rec['context']} | {rec['prefill_chunk'] or 'one pass'} | "
            f"{kv / MIB:.1f} | {rec['peak_rss_delta_bytes'] / MIB:.0f} | {over / MIB:+.0f} | {rec['prefill_s']:.1f} | "
            f"{ratio} |")


HEAD = ("| cache | batch x context | prefill chunk | cache MiB | peak RSS growth MiB | peak - cache MiB | prefill s | "
        "prefill / full's (same chunking) |\n|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--caches", nargs="+", default=list(CACHES))
    p.add_argument("--long", type=int, default=8000, help="the long prompt (batch 1), 0 to skip")
    p.add_argument("--long-caches", nargs="+", default=["full", "kivi-2", "hf-dynamic"])
    p.add_argument("--long-chunks", type=int, nargs="+", default=None,
                   help="prefill chunks of the long runs (default: --chunk and 0, one pass)")
    p.add_argument("--batch-run", default="4x4096", help="BxT run for the batch figure and the projection check")
    p.add_argument("--batch-caches", nargs="+", default=["full", "kivi-2"])
    p.add_argument("--budget", default="2GiB")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk of the chunked runs (default 512)")
    p.add_argument("--out", default=None, help="folder for results.json and capacity.png")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at a time (each is its own process, so peaks stay separate; times then overlap)")
    args = p.parse_args(argv)
    from kvsqueeze.eval.capacity import check_projection, parse_budget

    parse_budget(args.budget)
    results: dict = {"threads": args.threads, "chunk": args.chunk, "budget": args.budget}
    print(f"# peak memory and capacity, {args.threads} threads, prefill chunk {args.chunk}, {args.jobs} run(s) at a "
          f"time", file=sys.stderr)
    b, t = (int(x) for x in args.batch_run.lower().split("x"))
    jobs = []  # (group, kv, context, batch, chunk, budget)
    if args.long:
        jobs += [("long", kv, args.long, 1, chunk, None) for chunk in args.long_chunks or (args.chunk, 0)
                 for kv in args.long_caches]
    jobs += [("batch", kv, t, b, args.chunk, None) for kv in args.batch_caches]
    jobs += [("capacity", kv, 4096, 1, args.chunk, args.budget) for kv in args.caches]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        recs = list(pool.map(lambda j: speed(j[1], j[2], j[3], j[4], args.threads, j[5]), jobs))
    for group in ("long", "batch"):
        results[group] = [r for j, r in zip(jobs, recs) if j[0] == group]
    cap = {}
    for j, rec in zip(jobs, recs):
        if j[0] == "capacity":
            cap[j[1]] = rec["capacity"]
            cap[j[1]]["measured_on"] = {k: rec[k] for k in ("batch", "context", "prefill_chunk",
                                                            "peak_rss_delta_bytes")}
    results["capacity"] = cap
    checks = []
    for rec in results["batch"]:
        c = cap.get(rec["kv"])
        if c:
            cost = {"fixed_bytes": c["fixed_bytes"], "bytes_per_token": c["bytes_per_token"]}
            checks.append({"kv": rec["kv"], **check_projection(cost, c["transient_bytes_per_sequence"], rec)})
    results["projection_checks"] = checks

    print(HEAD)
    for group in ("long", "batch"):
        recs = results.get(group, [])
        for rec in recs:
            base = next((r for r in recs if r["kv"] == "full" and r["prefill_chunk"] == rec["prefill_chunk"]
                         and r["batch"] == rec["batch"]), None)
            print(row(rec, base))
    full = cap.get("full")
    print(f"\n| cache | bytes/token (one sequence) | fixed MiB | transient MiB/sequence | longest context in "
          f"{args.budget} (tokens) | x full | sequences of 4096 | x full |\n|---|---|---|---|---|---|---|---|")
    for kv, c in cap.items():
        xt = f"{c['max_tokens'] / full['max_tokens']:.1f}" if full and full["max_tokens"] else "-"
        xb = f"{c['max_batch'] / full['max_batch']:.1f}" if full and full["max_batch"] else "-"
        limit = f" (model: {c['max_context']})" if c["limited_by_model_positions"] else ""
        print(f"| {kv} | {c['bytes_per_token']:.0f} | {c['fixed_bytes'] / MIB:.1f} | "
              f"{c['transient_bytes_per_sequence'] / MIB:.1f} | {c['max_tokens']}{limit} | {xt} | {c['max_batch']} | "
              f"{xb} |")
    for ch in checks:
        print(f"projection check {ch['kv']} batch {ch['batch']} x {ch['context']}: predicted peak "
              f"{ch['predicted_peak_bytes'] / MIB:.0f} MiB, measured {ch['measured_peak_bytes'] / MIB:.0f} MiB "
              f"(measured / predicted {ch['ratio']:.2f})")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
        from kvsqueeze.eval.report import plot_capacity

        plot_capacity({"capacity": cap}, out / "capacity.png")
        print(f"wrote {out}/results.json and capacity.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
