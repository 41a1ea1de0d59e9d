"""Attention micro-benchmark: one decode step over L layers of cached K/V, packed kernels vs torch SDPA.

CPU section (always): SmolLM2-135M-shaped heads by default (3 KV heads, 9 query heads, head_dim 64), contexts
4k-64k, batch 1 (``--batch 1 8``: a row per batch size).  For each case: kvsqueeze's C++ kernel over full / int8 /
kivi-4 / kivi-2 packed blocks on every instruction-set path this CPU runs (``--isa`` picks; each is its own build),
and torch SDPA over the same data held as dense fp32 tensors.  Methods are interleaved per repetition; the median
is reported with bytes read per step (codes + scales + zero points + the fp window) and the implied GB/s, as a
share of the copy bandwidth measured in the same run (bytes read by a 512 MiB copy), and as a ratio to the same path's
``full`` (fp32) kernel.  ``--evict-mib N`` reads an N MiB buffer before every layer's call (untimed), as a model's
weights do between its attention layers, so the K/V come from memory rather than the last-level cache (the
in-model case: at 8k tokens the kernel took ~0.6 ms per SmolLM2 layer inside the model against ~0.44 ms warm).

GPU section (only with CUDA and Triton): 32 query heads, head_dim 128, 8 (GQA) or 32 KV heads, contexts 4k-128k,
batch 1 and 16, bf16: the fused Triton decode over kivi-4 / kivi-2 / int8 blocks (checked against SDPA over the
decoded K/V first: float32 SDPA over them, within 2e-2 or 1.5x bf16 SDPA's own deviation from it) vs SDPA over
bf16, with bytes read, GB/s and their share of the device copy bandwidth.
``--gpu-dry-run`` runs these sections on the CPU under ``TRITON_INTERPRET=1`` at toy sizes, to check this script
before a GPU call (tests/kernels/test_gpu_benchmark_dry_run.py); ``--gpu-graphs`` adds each method replayed from a
CUDA graph (kernel time, no Python); ``--gpu-configs
32:1024:4 64:4096:8:512`` times the decode once per launch shape (BLOCK_T tokens per loop iteration :
TARGET_PROGRAMS : NUM_WARPS [: CHUNK, the fewest tokens a program takes [: STAGES, Triton's num_stages]] of
kernels/triton_decode.py), a row each; the default is the module's own.  ``--gpu-codes16 both`` times each fused
method with 2- and 4-bit codes made from their bits (triton_common.codes16) and converted, a row each.
Then a GPU prefill section (``--prefill-tokens``, 0 skips; ``--prefill-contexts``, default the decode's): a chunk
of new tokens over a packed history through the Triton prefill kernel, the block-by-block torch reference
(``--no-prefill-reference`` leaves it out) and bf16 SDPA over the history unpacked (no mask: a lower bound);
``--prefill-routes tiled dense`` times the Triton prefill's two routes (kernels/triton_prefill.py) a row each.

    PYTHONPATH=src python benchmarks/attention_micro.py --threads 2 --layers 4 --contexts 4096 8192 16384 32768 65536
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import time
from typing import NamedTuple

import torch

CPU_PRESETS = ("full", "int8", "kivi-4", "kivi-2")


def build_layer(spec, k: torch.Tensor, v: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor):
    from kvsqueeze.cache.layer import LayerKV
    from kvsqueeze.spec import preset

    layer = LayerKV(preset(spec))
    layer.stage(k, v)
    layer.commit()
    layer.stage(new_k, new_v)  # the step's own token stays pending: attention never commits it
    return layer


def build_layers_in_arena(spec, data: list[tuple[torch.Tensor, ...]], chunk: int = 1024) -> list:
    """One layer per (k, v, new_k, new_v) of ``data`` as a model's cache holds them: blocks carved from one
    BlockArena, the prompt written ``chunk`` tokens at a time with the layers interleaved (a chunked prefill), the
    step's own token pending."""
    from kvsqueeze.cache.arena import BlockArena
    from kvsqueeze.cache.layer import LayerKV
    from kvsqueeze.spec import preset

    arena = BlockArena()
    layers = [LayerKV(preset(spec)) for _ in data]
    for la in layers:
        la.arena = arena
    for t in range(0, data[0][0].shape[2], chunk):
        for la, (k, v, _, _) in zip(layers, data):
            la.stage(k[:, :, t:t + chunk], v[:, :, t:t + chunk])
            la.commit()
    for la, (_, _, nk, nv) in zip(layers, data):
        la.stage(nk, nv)
    return layers


def layer_bytes(layer) -> int:
    n = layer.nbytes()
    return n["codes"] + n["params"] + n["fp"]


def copy_bandwidth(mib: int = 512, reps: int = 5) -> float:
    """GB/s of bytes read by a copy of ``mib`` MiB into a preallocated, already touched tensor (fastest of ``reps``):
    a clone into fresh memory also timed the page faults of its output, which halved the figure."""
    x = torch.empty(mib * 2**20 // 4).uniform_()
    y = torch.empty_like(x).zero_()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        y.copy_(x)
        ts.append(time.perf_counter() - t)
    return x.numel() * 4 / min(ts) / 1e9


def bench_cpu(args) -> None:
    from kvsqueeze.kernels import cpu

    if not cpu.available():
        print("C++ kernel unavailable; CPU section skipped")
        return
    kvh, qh, d, nl = args.kv_heads, args.q_heads, args.head_dim, args.layers
    isas = [i for i in (args.isa or cpu.runnable_isas()) if i in cpu.runnable_isas()]
    scale = d ** -0.5
    bw = copy_bandwidth()
    print(f"\n## CPU: {torch.get_num_threads()} threads, {nl} layers, {kvh} KV heads, {qh} query heads, head_dim {d}; "
          f"copy bandwidth {bw:.1f} GB/s (bytes read by a 512 MiB copy); kernel paths: {', '.join(isas)} "
          f"(this CPU runs: {', '.join(cpu.runnable_isas())})"
          + (f"; {args.evict_mib} MiB read before each layer's call (K/V from memory)" if args.evict_mib else "")
          + "\n")
    print("| batch | context | method | path | ms/step | MB read/step | GB/s | of copy bw | vs SDPA fp32 | vs full |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for batch in args.batch:
        for ctx in args.contexts:
            _cpu_case(args, cpu, isas, batch, ctx, kvh, qh, d, nl, scale, bw)


def _cpu_case(args, cpu, isas, batch, ctx, kvh, qh, d, nl, scale, bw) -> None:
    from kvsqueeze.eval.benchkit import shuffled_rounds

    g = torch.Generator().manual_seed(ctx)
    layers: dict[str, list] = {p: [] for p in args.presets}
    dense32, qs, data = [], [], []
    for _ in range(nl):
        k = torch.randn(batch, kvh, ctx, d, generator=g) * 1.5 + 0.3
        v = torch.randn(batch, kvh, ctx, d, generator=g)
        nk, nv = torch.randn(batch, kvh, 1, d, generator=g), torch.randn(batch, kvh, 1, d, generator=g)
        if args.arena:
            data.append((k, v, nk, nv))
        else:
            for p in args.presets:
                layers[p].append(build_layer(p, k, v, nk, nv))
        dense32.append((torch.cat([k, nk], 2), torch.cat([v, nv], 2)))
        qs.append(torch.randn(batch, qh, 1, d, generator=g))
        del k, v
    if args.arena:
        layers = {p: build_layers_in_arena(p, data) for p in args.presets}
        del data

    evict = torch.empty(args.evict_mib * 2**18) if args.evict_mib else None  # float32: 4 bytes each
    if evict is not None:
        evict.uniform_()

    def timed_layers(calls) -> float:
        """Seconds spent in the calls, each after the eviction read when --evict-mib is set."""
        total = 0.0
        for call in calls:
            if evict is not None:
                evict.sum()
            t = time.perf_counter()
            call()
            total += time.perf_counter() - t
        return total

    def sdpa(qs=qs, dense=dense32):
        return timed_layers(lambda q=q, kk=kk, vv=vv: torch.nn.functional.scaled_dot_product_attention(
            q, kk, vv, scale=scale, enable_gqa=qh != kvh) for q, (kk, vv) in zip(qs, dense))

    def ours(ls, isa, order, qs=qs):
        with cpu.use_isa(isa), cpu.use_order(order):
            return timed_layers(lambda q=q, layer=layer: cpu.attend(q, layer.plan(), None, scale)
                                for q, layer in zip(qs, ls))

    def label(p, order):  # the default traversal unmarked, as in the tables before --orders
        return f"kvsqueeze {p}" + ("" if order == cpu.TRAVERSALS[0] else f" ({order} order)")

    cases = [(p, isa, o) for isa in isas for o in args.orders for p in args.presets]
    methods = {(label(p, o), isa): (lambda ls=layers[p], isa=isa, o=o: ours(ls, isa, o)) for p, isa, o in cases}
    methods[("SDPA fp32", "torch")] = sdpa
    nbytes = {(label(p, o), isa): sum(layer_bytes(la) for la in layers[p]) for p, isa, o in cases}
    full_of = {(label(p, o), isa): (label("full", o), isa) for p, isa, o in cases}  # "vs full": the same order
    nbytes[("SDPA fp32", "torch")] = sum(kk.numel() * 8 for kk, _ in dense32)
    times: dict[tuple, list[float]] = {m: [] for m in methods}
    for fn in methods.values():
        fn()  # warm-up (and the first use of each build)
    # Interleaved, so load changes hit every method alike, in a new order each repetition: in a fixed order the
    # method after SDPA (which reads the widest tensors) always met a cache SDPA had emptied, 10-25% slower on a
    # Zen 4 (one layer at 8k), enough to rank the AVX-512 build behind the AVX2 one for `full`.
    for order in shuffled_rounds(list(methods.items()), args.reps, seed=ctx):
        for m, fn in order:
            times[m].append(fn())
    base = statistics.median(times[("SDPA fp32", "torch")])
    for (name, path), ts in times.items():
        med = statistics.median(ts)
        full = times.get(full_of.get((name, path)))
        vs_full = f"{statistics.median(full) / med:.2f}x" if full else "-"
        gbs = nbytes[(name, path)] / med / 1e9
        print(f"| {batch} | {ctx} | {name} | {path} | {med * 1e3:.2f} | {nbytes[(name, path)] / 1e6:.1f} | {gbs:.1f} | "
              f"{gbs / bw:.0%} | {base / med:.2f}x | {vs_full} |")


def gpu_copy_bandwidth(gib: float = 2.0) -> float:
    """GB/s of a device-to-device copy of ``gib`` GiB, counting bytes read and written (median of 10)."""
    x = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    ms = _device_ms(lambda: y.copy_(x), 10, x.device)
    return 2 * x.numel() * 2 / (ms / 1e3) / 1e9


def _sdpa_bf16(q, k, v, gqa: bool):
    """torch SDPA over dense bf16 K/V with GQA in the kernel (no repeated K/V): flash where it takes GQA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    except RuntimeError:  # flash refused this case: torch's own choice
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)


def _gpu_device(args, section: str) -> torch.device | None:
    """The device of the GPU sections: CUDA, or with ``--gpu-dry-run`` the CPU under Triton's interpreter (the
    benchmark's own code checked at toy sizes; its times mean nothing); None, having said why, when neither."""
    if args.gpu_dry_run:
        from kvsqueeze.kernels import triton_common

        if torch.cuda.is_available() or not triton_common.interpreting():
            raise SystemExit("--gpu-dry-run runs the GPU sections on the CPU under TRITON_INTERPRET=1, without a GPU")
        print(f"\n## {section}: DRY RUN on the CPU under Triton's interpreter (times mean nothing)")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        print(f"\n## {section}: no CUDA device; section skipped")
        return None
    return torch.device("cuda")


def bench_gpu(args) -> None:
    """One decode step of one layer (32 query heads, head_dim 128, bf16): the fused Triton decode over packed blocks
    (one launch through the layer's pool, plus the exact segments and a combine) against SDPA over bf16, with the
    bytes each reads per step and the GB/s they imply beside the device copy bandwidth measured in the same run."""
    dev = _gpu_device(args, "GPU")
    if dev is None:
        return
    try:
        from kvsqueeze.kernels import triton_decode
        from kvsqueeze.kernels.triton_common import side
    except ImportError as err:
        print(f"\n## GPU: Triton kernels unavailable ({err}); section skipped")
        return
    if not triton_decode.available():
        print("\n## GPU: Triton kernels unavailable; section skipped")
        return
    dt = torch.bfloat16
    configs = args.gpu_configs or [LaunchShape.current()]
    cuda = dev.type == "cuda"
    bw = gpu_copy_bandwidth() if cuda else 2 * copy_bandwidth(64, 2)
    print(f"\n## GPU: {torch.cuda.get_device_name() if cuda else 'CPU'}, one layer per step, 32 query heads, "
          f"head_dim 128, bf16; device copy {bw:.0f} GB/s (read + written)\n")
    print("| heads q/kv | batch | context | method | ms/step | MB read | GB/s | of copy | vs SDPA bf16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kvh in args.gpu_kv_heads:
        for batch in args.gpu_batch:
            for ctx in args.gpu_contexts:
                if batch * ctx * kvh * 128 * 2 * 2 > args.gpu_budget_gb * 2**30:
                    continue
                k = torch.randn(batch, kvh, ctx, 128, device=dev, dtype=dt)
                v = torch.randn_like(k)
                q = torch.randn(batch, 32, 1, 128, device=dev, dtype=dt)
                nk, nv = torch.randn_like(k[:, :, :1]), torch.randn_like(v[:, :, :1])
                layers = {p: build_layer(p, k, v, nk, nv) for p in args.gpu_presets}
                kk, vv = torch.cat([k, nk], 2), torch.cat([v, nv], 2)
                del k, v
                methods = {"SDPA bf16": (lambda kk=kk, vv=vv, q=q, kvh=kvh: _sdpa_bf16(q, kk, vv, kvh != 32),
                                         2 * kk.numel() * kk.element_size())}
                for p, la in layers.items():
                    if triton_decode.path(q, la.plan()) != "triton":
                        print(f"| 32/{kvh} | {batch} | {ctx} | fused {p} | not served by the Triton decode |")
                        continue
                    # the reference: float32 SDPA over the decoded K/V; the bound: 2e-2, or 1.5x bf16 SDPA's own
                    # deviation from it over the same K/V where that is larger (bf16 operands alone move 2-bit
                    # keys' outputs by 2.7% at 32k tokens: SDPA's as much as the fused decode's)
                    dk, dv = (torch.cat([s[i] for s in la.plan().decoded()], 2) for i in (1, 2))
                    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), dk.float(), dv.float(),
                                                                           enable_gqa=kvh != 32)
                    own = (_sdpa_bf16(q, dk.to(dt), dv.to(dt), kvh != 32).float() - ref).norm() / ref.norm()
                    bound = max(2e-2, 1.5 * float(own))
                    del dk, dv
                    for cfg, c16 in itertools.product(configs, _codes16_values(args)):
                        name = f"fused {p}" + (f" {cfg}" if len(configs) > 1 else "") + _codes16_name(args, c16)
                        ran = _with_launch(cfg, lambda la=la: triton_decode.tile_tokens(
                            *(side(f) for f in (la.plan().key_format, la.plan().value_format))))
                        if ran != min(cfg.block_t, cfg.chunk):  # (sub-byte codes take 32-token tiles on a GPU)
                            name += f" (ran bt{ran})"

                        def fn(la=la, q=q, cfg=cfg, c16=c16):
                            return _with_launch(cfg, lambda: triton_decode.attend(q, la.plan(), None, 128 ** -0.5),
                                                c16)

                        try:  # a failing shape or format is a row of its own, not the end of the table
                            err = (fn().float() - ref.float()).norm() / ref.float().norm()
                        except Exception as exc:  # noqa: BLE001
                            print(f"| 32/{kvh} | {batch} | {ctx} | {name} | FAILED: {type(exc).__name__}: "
                                  f"{str(exc)[:300]} |")
                            continue
                        if not err < bound:
                            print(f"| 32/{kvh} | {batch} | {ctx} | {name} | WRONG: differs from float32 SDPA over its "
                                  f"decoded K/V by {err:.2e} (bf16 SDPA: {own:.2e}) |")
                            continue
                        methods[name] = (fn, layer_bytes(la))
                if args.gpu_graphs and cuda:  # the same calls replayed from CUDA graphs: no Python in the time
                    for m, (fn, nbytes) in list(methods.items()):
                        try:
                            methods[f"{m} (graph)"] = (_graphed(fn), nbytes)
                        except Exception as exc:  # noqa: BLE001
                            print(f"| 32/{kvh} | {batch} | {ctx} | {m} (graph) | FAILED: {type(exc).__name__}: "
                                  f"{str(exc)[:300]} |")
                res = {m: _device_ms(fn, args.reps, dev) for m, (fn, _) in methods.items()}
                for m, t in res.items():
                    nbytes = methods[m][1]
                    gbs = nbytes / (t / 1e3) / 1e9
                    base = res["SDPA bf16 (graph)" if m.endswith("(graph)") else "SDPA bf16"]
                    print(f"| 32/{kvh} | {batch} | {ctx} | {m} | {t:.3f} | {nbytes / 1e6:.1f} | {gbs:.0f} | "
                          f"{gbs / bw:.0%} | {base / t:.2f}x |")
                del layers, kk, vv
                if cuda:
                    torch.cuda.empty_cache()


class LaunchShape(NamedTuple):
    """The decode's launch shape (kernels/triton_decode.py module attributes), swept by ``--gpu-configs``."""

    block_t: int
    programs: int
    warps: int
    chunk: int
    stages: int = 0

    @classmethod
    def parse(cls, text: str) -> LaunchShape:
        from kvsqueeze.kernels import triton_decode as td

        try:
            return cls(*td.parse_launch(text))
        except ValueError as err:
            raise SystemExit(f"--gpu-configs: {err}") from None

    @classmethod
    def current(cls) -> LaunchShape:
        from kvsqueeze.kernels import triton_decode as td

        return cls(td.BLOCK_T, td.TARGET_PROGRAMS, td.NUM_WARPS, td.CHUNK, td.NUM_STAGES)

    def __str__(self) -> str:
        return f"bt{self.block_t} p{self.programs} w{self.warps} c{self.chunk}" + (f" s{self.stages}" if self.stages
                                                                                  else "")


def _with_launch(cfg: LaunchShape | None, fn, codes16: bool | None = None):
    """Run ``fn`` with the decode's launch shape set to ``cfg`` and, unless None, 2-/4-bit codes made from their
    bits on or off (kernels/triton_common.py CODES16); the modules' own settings restored after."""
    from kvsqueeze.kernels import triton_common as tc
    from kvsqueeze.kernels import triton_decode as td

    saved, saved16 = LaunchShape.current(), tc.CODES16
    td.BLOCK_T, td.TARGET_PROGRAMS, td.NUM_WARPS, td.CHUNK, td.NUM_STAGES = cfg or saved
    tc.CODES16 = saved16 if codes16 is None else codes16
    try:
        return fn()
    finally:
        td.BLOCK_T, td.TARGET_PROGRAMS, td.NUM_WARPS, td.CHUNK, td.NUM_STAGES = saved
        tc.CODES16 = saved16


def _codes16_values(args) -> list[bool | None]:
    """The CODES16 settings ``--gpu-codes16`` asks for (None: the module's own)."""
    return {"default": [None], "on": [True], "off": [False], "both": [True, False]}[args.gpu_codes16]


def _codes16_name(args, c16: bool | None) -> str:
    return "" if args.gpu_codes16 == "default" else (" codes16" if c16 else " cvt")


def _graphed(fn):
    """``fn``'s launches captured once in a CUDA graph; returns its replay (warmed up on a side stream first, as
    capture needs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _device_ms(fn, reps: int, dev: torch.device) -> float:
    """Median ms of ``fn`` after one warm-up call: CUDA events on a GPU, the wall clock on the CPU (dry runs)."""
    if dev.type != "cuda":
        fn()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts)
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


@contextlib.contextmanager
def _prefill_route(route: str):
    """KVSQUEEZE_TRITON_PREFILL_DENSE for one row: auto (the module's rule), tiled (0) or dense (1)."""
    saved = os.environ.get("KVSQUEEZE_TRITON_PREFILL_DENSE")
    os.environ["KVSQUEEZE_TRITON_PREFILL_DENSE"] = {"auto": "auto", "tiled": "0", "dense": "1"}[route]
    try:
        yield
    finally:
        if saved is None:
            del os.environ["KVSQUEEZE_TRITON_PREFILL_DENSE"]
        else:
            os.environ["KVSQUEEZE_TRITON_PREFILL_DENSE"] = saved


def bench_gpu_prefill(args) -> None:
    """A chunk of new tokens attending over a packed history (chunked prefill): the Triton prefill kernel vs the
    block-by-block torch reference and vs bf16 SDPA over dense K/V (no mask, a lower bound)."""
    dev = _gpu_device(args, "GPU prefill")
    if dev is None:
        return
    from kvsqueeze.kernels import reference, triton_decode

    if not triton_decode.available():
        print("\n## GPU prefill: Triton kernels unavailable; section skipped")
        return
    n = args.prefill_tokens
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU"
    print(f"\n## GPU prefill: {name}, {n} new tokens over the context, 32 query heads, 8 KV heads, head_dim 128, "
          f"batch 1, bf16\n")
    print("| context | method | ms/step | vs SDPA bf16 |")
    print("|---|---|---|---|")
    dt = torch.bfloat16
    for ctx in args.prefill_contexts or args.gpu_contexts:
        k = torch.randn(1, 8, ctx, 128, device=dev, dtype=dt)
        v = torch.randn_like(k)
        q = torch.randn(1, 32, n, 128, device=dev, dtype=dt)
        nk, nv = torch.randn(1, 8, n, 128, device=dev, dtype=dt), torch.randn(1, 8, n, 128, device=dev, dtype=dt)
        kk, vv = torch.cat([k, nk], 2), torch.cat([v, nv], 2)
        res = {"SDPA bf16": _device_ms(lambda q=q, kk=kk, vv=vv: _sdpa_bf16(q, kk, vv, True), args.reps, dev)}
        for p, c16, route in itertools.product(("kivi-4", "kivi-2"), _codes16_values(args), args.prefill_routes):
            la = build_layer(p, k, v, nk, nv)
            with _prefill_route(route):
                label = "" if args.prefill_routes == ["auto"] else f" ({triton_decode.path(q, la.plan())})"
                res[f"triton prefill {p}{_codes16_name(args, c16)}{label}"] = _device_ms(
                    lambda la=la, q=q, c16=c16: _with_launch(
                        None, lambda: triton_decode.attend(q, la.plan(), None, 128 ** -0.5), c16), args.reps, dev)
            if args.prefill_reference:
                res[f"torch reference {p}"] = _device_ms(
                    lambda la=la, q=q: reference.attend(q, la.plan(), None, 128 ** -0.5), max(3, args.reps // 5), dev)
            del la
        for m, t in res.items():
            print(f"| {ctx} | {m} | {t:.3f} | {res['SDPA bf16'] / t:.2f}x |")
        del k, v, kk, vv
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    from kvsqueeze.kernels.cpu import TRAVERSALS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="CPU: sequences per step (one table row each)")
    p.add_argument("--presets", nargs="+", default=list(CPU_PRESETS), help="CPU: kvsqueeze presets to time")
    p.add_argument("--isa", nargs="+", default=None,
                   help="CPU: C++ kernel paths to time (default: every path this CPU runs; see kernels/cpu.py ISAS)")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--gpu-contexts", type=int, nargs="+", default=[4096, 16384, 32768, 65536, 131072])
    p.add_argument("--gpu-budget-gb", type=float, default=40.0, help="skip GPU shapes whose bf16 K/V exceed this")
    p.add_argument("--gpu-kv-heads", type=int, nargs="+", default=[8, 32], help="GPU: KV heads (32 query heads)")
    p.add_argument("--gpu-batch", type=int, nargs="+", default=[1, 16], help="GPU: sequences per step")
    p.add_argument("--gpu-presets", nargs="+", default=["kivi-4", "kivi-2", "int8"], help="GPU: presets to time")
    p.add_argument("--gpu-configs", nargs="+", type=LaunchShape.parse, default=None,
                   metavar="BT:PROGRAMS:WARPS[:CHUNK[:STAGES]]",
                   help="GPU: decode launch shapes to time, a row each (default: kernels/triton_decode.py's own)")
    p.add_argument("--gpu-codes16", choices=("default", "on", "off", "both"), default="default",
                   help="GPU: 2- and 4-bit codes made into 16-bit operands from their bits (on), or converted through "
                        "float32 (off), or a row each (both); default: the kernels' own setting")
    p.add_argument("--gpu-dry-run", action="store_true",
                   help="run the GPU sections on the CPU under TRITON_INTERPRET=1 (checks this script's code before "
                        "a GPU call; use toy sizes, the times mean nothing)")
    p.add_argument("--gpu-graphs", action="store_true",
                   help="GPU: also time every method replayed from a CUDA graph (its kernels without the Python)")
    p.add_argument("--prefill-tokens", type=int, default=512, help="new tokens per GPU prefill step (0: skip)")
    p.add_argument("--prefill-contexts", type=int, nargs="+", default=None,
                   help="GPU prefill: history lengths (default: --gpu-contexts)")
    p.add_argument("--prefill-routes", nargs="+", default=["auto"], choices=["auto", "tiled", "dense"],
                   help="GPU prefill: the Triton routes to time, a row each (auto: kernels/triton_prefill.dense "
                        "decides; tiled: the tiled kernel; dense: unpacked once, then SDPA)")
    p.add_argument("--no-prefill-reference", dest="prefill_reference", action="store_false",
                   help="GPU prefill: leave out the block-by-block torch reference (slow and large at long chunks)")
    p.add_argument("--skip-cpu", action="store_true")
    p.add_argument("--arena", action="store_true",
                   help="CPU: blocks carved from one arena, the prompt written 1024 tokens at a time with the layers "
                        "interleaved (a model's cache; default: each layer's blocks allocated one by one)")
    p.add_argument("--orders", nargs="+", default=[TRAVERSALS[0]], choices=TRAVERSALS,
                   help="CPU: the decode kernel's traversal orders to time (KVSQUEEZE_CPU_ORDER), rows for each")
    p.add_argument("--evict-mib", type=int, default=0,
                   help="CPU: read this many MiB before every layer's call (untimed): K/V from memory, as in a model")
    args = p.parse_args(argv)
    from kvsqueeze.eval.benchkit import set_threads

    set_threads(args.threads)
    if not args.skip_cpu:
        bench_cpu(args)
    bench_gpu(args)
    if args.prefill_tokens:
        bench_gpu_prefill(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
