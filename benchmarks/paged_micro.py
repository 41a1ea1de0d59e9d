"""Paged decode micro-benchmark: kvsqueeze's C++ kernel over K/V in a vLLM-style paged pool vs kvsqueeze's own cache.

One decode step (one query token per sequence) over ``--batch`` sequences of ``--context`` tokens, SmolLM2-135M
heads (3 KV heads, 9 query heads, head_dim 64), per format:

* ``paged``: the K/V written as bf16 tokens into a pool of 32-token pages (kernels/paged.py: a page is packed when
  its last token is written, the last partial page stays in full precision) and read in place by
  :func:`kvsqueeze.kernels.paged.paged_attention` (one ``attend_paged`` call for the step), as the vLLM plugin does
  per layer;
* ``own``: the same preset's own cache (kvsqueeze's ``LayerKV``: 256-token blocks, its window in fp32) holding
  random K/V of the same shapes, read by ``cpu.attend``.

Both are timed in rounds, each in a new order (``benchkit.interleaved_medians``), and the medians printed with
their ratio.

    PYTHONPATH=src python benchmarks/paged_micro.py --threads 2 --batch 8 --context 2048 --formats kivi-4 kivi-2 int8
"""

from __future__ import annotations

import argparse

import torch

from kvsqueeze.eval import benchkit

PAGE = 32  # tokens per page (the plugin's vLLM block size)
KV_HEADS, Q_HEADS, HEAD_DIM = 3, 9, 64


def paged_case(name: str, batch: int, context: int, g: torch.Generator):
    """A pool holding ``batch`` sequences of ``context`` tokens in format ``name``, and a step's call over it."""
    from kvsqueeze.kernels.paged import PagedStore, paged_attention, paged_format

    fmt = paged_format(name)
    per_seq = context // PAGE + 1
    pool = torch.zeros(batch * per_seq, KV_HEADS, fmt.token_bytes(PAGE, HEAD_DIM) * PAGE, dtype=torch.uint8)
    store = PagedStore(fmt, PAGE, KV_HEADS, HEAD_DIM)
    table = torch.arange(batch * per_seq).view(batch, per_seq)
    pos = torch.arange(context)
    for s in range(batch):
        k = (torch.randn(context, KV_HEADS, HEAD_DIM, generator=g) * 1.5 + 0.3).bfloat16()
        v = torch.randn(context, KV_HEADS, HEAD_DIM, generator=g).bfloat16()
        store.write(pool, k, v, table[s, pos // PAGE] * PAGE + pos % PAGE)
    lens, starts = torch.full((batch,), context), torch.arange(batch + 1)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, generator=g).bfloat16()
    return lambda: paged_attention(q, store, pool, table, lens, starts, HEAD_DIM ** -0.5)


def own_case(name: str, batch: int, context: int, g: torch.Generator):
    from kvsqueeze.cache.layer import LayerKV
    from kvsqueeze.kernels import cpu
    from kvsqueeze.spec import preset

    k = torch.randn(batch, KV_HEADS, context, HEAD_DIM, generator=g) * 1.5 + 0.3
    v = torch.randn(batch, KV_HEADS, context, HEAD_DIM, generator=g)
    layer = LayerKV(preset(name))
    layer.stage(k[:, :, :-1], v[:, :, :-1])
    layer.commit()
    layer.stage(k[:, :, -1:], v[:, :, -1:])  # the step's own token stays pending, as in a decode step
    plan = layer.plan()
    q = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, generator=g)
    return lambda: cpu.attend(q, plan, None, HEAD_DIM ** -0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--formats", nargs="+", default=["kivi-4", "kivi-2", "int8"],
                    choices=["kivi-4", "kivi-2", "int8"])
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    from kvsqueeze.kernels import cpu

    threads = benchkit.set_threads(args.threads)
    if cpu.load_extension() is None:
        raise SystemExit(f"paged_micro: the C++ kernel is not built here ({cpu.describe()['reason']})")
    print(f"## Paged decode: batch {args.batch} x {args.context} tokens, {KV_HEADS} KV / {Q_HEADS} query heads, "
          f"head_dim {HEAD_DIM}, kernel path {cpu.selected_isa()}; medians of {args.reps} interleaved steps\n")
    print(benchkit.machine_line(threads) + "\n")
    print("| format | paged pool (32-token pages) ms | own cache (256-token blocks) ms | paged / own |")
    print("|---|---|---|---|")
    for name in args.formats:
        g = torch.Generator().manual_seed(0)
        fns = {"paged": paged_case(name, args.batch, args.context, g), "own": own_case(name, args.batch, args.context, g)}
        med = benchkit.interleaved_medians(fns, args.reps)
        p, o = med["paged"] * 1e3, med["own"] * 1e3
        print(f"| {name} | {p:.3f} | {o:.3f} | {p / o:.2f}x |")

if __name__ == "__main__":
    main()
