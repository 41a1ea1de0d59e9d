"""End-to-end CPU decode speed: kvsqueeze presets vs transformers' DynamicCache and quanto QuantizedCache.

Embedded SmolLM2-135M, batch 1 (``--batch B``: B random prompts decoded together).  For every context length each cache is prefilled with the same random prompt
(timed), then decode steps are interleaved across the caches (step i of every cache before step i+1 of any), so
background load on a shared machine hits every preset alike.  Prints a markdown table (median decode ms/token,
prefill s) and the ratios the issue asks for.

    PYTHONPATH=src python benchmarks/decode_speed.py --threads 2 --contexts 1024 4096 8192 --steps 24
    PYTHONPATH=src python benchmarks/decode_speed.py --threads 2 --contexts 4096 --batch 8 --copy-prefill \
        --presets full kivi-4 kivi-2 hf-quanto-int4 --steps 12

The table's "in attention" column is the median time a decode step spends inside the attention function
(kvsqueeze's kernel and its step's commit; transformers' SDPA for its caches, whose cache updates - quanto's
dequantization included - run before it and count as the rest of the step): with it, each ratio line prints the
bound a cache's decode/full ratio could reach were its attention free (its step minus its attention, over full's step).

Each decode step also prints the packed bytes kvsqueeze's attention reads per step (codes + scales + the exact
window/sinks of every layer) divided by the step's median time: a lower bound of the read bandwidth reached.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable

import torch

OURS = ("full", "int8", "kivi-4", "kivi-2")
PEERS = ("hf-dynamic", "hf-quanto-int4", "hf-quanto-int2")


def make_cache(name: str, model, backend: str):
    from transformers import DynamicCache
    from transformers import QuantizedCache as HFQuantizedCache

    from kvsqueeze.adapter import QuantizedCache

    if name == "hf-dynamic":
        model.config._attn_implementation = "sdpa"
        return DynamicCache(config=model.config)
    if name.startswith("hf-quanto-int"):
        model.config._attn_implementation = "sdpa"
        return HFQuantizedCache(backend="quanto", config=model.config, nbits=int(name[-1]), q_group_size=64,
                                residual_length=128)
    return QuantizedCache(model.config, name, backend=backend)


def set_attention(model, name: str) -> None:
    """Each cache needs its model attention function; switch before every call (caches are interleaved)."""
    impl = "sdpa" if name.startswith("hf-") else "kvsqueeze"
    for cfg in (model.config, model.config.get_text_config(decoder=True)):
        cfg._attn_implementation = impl


def timed(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def fill_from(cache, name: str, model, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Load prefilled K/V into a cache as a prefill would (each cache quantizes them itself)."""
    set_attention(model, name)
    for i, (k, v) in enumerate(kv):
        if name.startswith("hf-"):
            cache.update(k, v, i)
        else:  # kvsqueeze's layer directly: what its attention does after a step (stage, then commit)
            cache.layers[i].kv.stage(k, v)
            cache.layers[i].kv.commit()


@torch.inference_mode()
def run_context(model, names: list[str], context: int, steps: int, backend: str, seed: int,
                copy_prefill: bool = False, prefill_repeats: int = 1, batch: int = 1) -> dict:
    from kvsqueeze.adapter import attention_clock, cache_kwargs

    g = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    prompt = torch.randint(100, vocab - 100, (batch, context), generator=g)
    state = {}
    shared = None
    warm = prompt[:, :128]
    for name in names:  # warm-up: the first forward of each cache kind pays one-off costs (allocator, kernels)
        set_attention(model, name)
        model(warm, **cache_kwargs(model, make_cache(name, model, backend)), use_cache=True, logits_to_keep=1)
    gc.collect()
    for _ in range(1 if copy_prefill else prefill_repeats):  # rounds interleave the caches; the fastest counts
        for name in names:  # prefill, one cache at a time (each holds its own copy of the context)
            cache = make_cache(name, model, backend)
            if copy_prefill and shared is not None:
                fill_from(cache, name, model, shared[0])
                state[name] = {"cache": cache, "next": shared[1], "prefill": float("nan"), "steps": [],
                               "pos": context}
                continue
            state.pop(name, None)
            gc.collect()
            set_attention(model, name)
            t = time.perf_counter()
            out = model(prompt, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1).logits
            dt = time.perf_counter() - t
            best = min(dt, state.get(name, {}).get("prefill", float("inf")))
            state[name] = {"cache": cache, "next": out[:, -1:].argmax(-1), "prefill": best, "steps": [],
                           "pos": context, "prefills": [*state.get(name, {}).get("prefills", []), dt]}
            if copy_prefill:
                from transformers import DynamicCache

                ref = DynamicCache(config=model.config)
                fill_from(ref, "hf-dynamic", model, [(lay.keys, lay.values) for lay in cache.layers]
                          if name.startswith("hf-dynamic") else _dense(cache))
                shared = ([(lay.keys.clone(), lay.values.clone()) for lay in ref.layers], state[name]["next"])
            gc.collect()
    with attention_clock() as clock:
        for _ in range(steps):  # decode, interleaved
            for name in names:
                st = state[name]
                set_attention(model, name)
                pos = torch.tensor([st["pos"]])

                def step(st=st, pos=pos):
                    return model(st["next"], **cache_kwargs(model, st["cache"]), use_cache=True,
                                 cache_position=pos).logits

                before = clock.seconds
                out, dt = timed(step)
                st["steps"].append(dt)
                st.setdefault("attention", []).append(clock.seconds - before)
                st["next"] = out[:, -1:].argmax(-1)
                st["pos"] += 1

    def median_ms(xs: list[float]) -> float:
        return 1e3 * statistics.median(xs[1:] or xs)

    if not clock.calls:  # a model on its own eager attention: nothing was clocked
        raise SystemExit("decode_speed.py: the model's attention is not one the clock sees (SDPA or kvsqueeze's)")
    result = {n: {"prefill": s["prefill"], "decode_ms": median_ms(s["steps"]),
                  "attention_ms": median_ms(s["attention"]),
                  "rest_ms": median_ms([t - a for t, a in zip(s["steps"], s["attention"])]),
                  "kv_bytes": _kv_bytes(s["cache"])} for n, s in state.items()}
    del state
    gc.collect()
    return result


def _kv_bytes(cache) -> int:
    from kvsqueeze.eval.peers import footprint

    return footprint(cache).total


def _dense(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K/V of a kvsqueeze "full" cache as dense tensors (sinks, blocks, window)."""
    out = []
    for layer in cache.layers:
        segs = [(k, v) for _, k, v, _ in layer.kv.plan().decoded()]
        out.append((torch.cat([k for k, _ in segs], 2), torch.cat([v for _, v in segs], 2)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--steps", type=int, default=24, help="decode steps per cache (first one not counted)")
    p.add_argument("--presets", nargs="+", default=list(OURS + PEERS))
    p.add_argument("--backend", default="auto", help="kvsqueeze attention backend (auto, cpu, torch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=1, help="prompts decoded together (default 1)")
    p.add_argument("--prefill-repeats", type=int, default=2,
                   help="prefill rounds over all caches (interleaved); the fastest of each cache counts (default 2)")
    p.add_argument("--copy-prefill", action="store_true",
                   help="prefill only the first preset; the others get its K/V (decode timing only, saves time)")
    args = p.parse_args(argv)

    from kvsqueeze.eval.benchkit import load

    model, _, _ = load(args)
    if args.backend in ("auto", "cpu"):
        from kvsqueeze.kernels import cpu

        print(f"C++ kernel available: {cpu.available()}", file=sys.stderr)
    rows = {}
    for ctx in args.contexts:
        t = time.perf_counter()
        rows[ctx] = run_context(model, args.presets, ctx, args.steps, args.backend, args.seed, args.copy_prefill,
                                args.prefill_repeats, args.batch)
        print(f"context {ctx}: {time.perf_counter() - t:.0f} s", file=sys.stderr)

    print(f"\nCPU decode, SmolLM2-135M fp32, batch {args.batch}, {args.threads} threads, backend={args.backend}, "
          f"median of {args.steps - 1} interleaved steps; prefill = fastest of "
          f"{args.prefill_repeats} interleaved rounds after a warm-up\n")
    head = "| preset | " + " | ".join(f"{c} decode ms/tok | {c} in attention | {c} prefill s"
                                      for c in args.contexts) + " |"
    print(head)
    print("|" + "---|" * (1 + 3 * len(args.contexts)))
    for name in args.presets:
        cells = [f"{rows[c][name]['decode_ms']:.1f} | {rows[c][name]['attention_ms']:.1f} | "
                 f"{rows[c][name]['prefill']:.2f}" for c in args.contexts]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nratios (decode ms/token; prefill s)")
    for ctx in args.contexts:
        r = rows[ctx]
        for name in ("kivi-4", "kivi-2", "int8"):
            if name not in r:
                continue
            parts = []
            if "full" in r:
                parts.append(f"decode/full {r[name]['decode_ms'] / r['full']['decode_ms']:.2f}")
                # the step without its attention (projections, MLPs, norms, head) over full's whole step: the
                # ratio this cache would reach were its attention free
                parts.append(f"attention/full {r[name]['attention_ms'] / r['full']['attention_ms']:.2f}, "
                             f"bound with free attention {r[name]['rest_ms'] / r['full']['decode_ms']:.2f}")
                parts.append(f"prefill/full {r[name]['prefill'] / r['full']['prefill']:.2f}")
            if "hf-quanto-int4" in r:
                parts.append(f"quanto-int4/this decode {r['hf-quanto-int4']['decode_ms'] / r[name]['decode_ms']:.2f}x")
            if "hf-dynamic" in r:
                parts.append(f"decode/hf-dynamic {r[name]['decode_ms'] / r['hf-dynamic']['decode_ms']:.2f}")
            parts.append(f"KV read {r[name]['kv_bytes'] / 2**20:.0f} MiB/step = "
                         f"{r[name]['kv_bytes'] / r[name]['decode_ms'] / 1e6:.2f} GB/s")
            print(f"  {ctx:>6} {name:<7} " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
