"""Compile every Triton kernel for a GPU target on a machine without a GPU, and say which compile.

Triton's interpreter (how the kernels are tested without a GPU) runs the kernels' Python, not the compiler: a
kernel can pass every interpreted test and still fail to compile (types, layouts, constexpr use).  This drives the
same Python entry points as the tests (decode, prefill, the static cache's decode, quantize-and-pack) with every
launch replaced by a compilation for ``--arch`` (PTX and cubin through the ptxas Triton ships), nothing launched.

    python benchmarks/triton_compile_check.py            # every format x dtype x step kind, sm_90
    python benchmarks/triton_compile_check.py --quick    # one format per kernel (the test suite's run)
    python benchmarks/triton_compile_check.py --quick --resources --block-t 64 --num-warps 8
                                   # ptxas's registers and spills per kernel (most of any variant), at a launch shape
    python benchmarks/triton_compile_check.py --launch 32:4096:1   # the decode at a whole launch shape

Each kernel's line also counts variants whose PTX carries the mark of the address miscompile found on an H200
(2026-11-27, Triton 3.6, one warp per program): a 32-bit thread index multiplied into 64 bits by 2^28 or more
(``mul.wide.u32 %rd, %r, 1073741824``), whose high half then lands in a byte offset - 16-byte copies from odd
addresses, "misaligned address" on the device.  Triton 3.9 compiles the same kernels without it.

Exit status 1 when any compilation failed (the first error of each kernel is printed).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections import Counter
from pathlib import Path
from unittest import mock

import torch

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run without TRITON_INTERPRET: the point is the compiler, not the interpreter")

import triton  # noqa: E402
from triton.backends.compiler import (
    BaseBackend,  # noqa: E402
    GPUTarget,  # noqa: E402
)
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction, native_specialize_impl  # noqa: E402

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.uint8: "u8",
          torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
          torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}


class Compiler:
    """Stands in for JITFunction.run: binds a launch's arguments to the kernel's parameters, compiles."""

    def __init__(self, target: GPUTarget, resources: bool = False):
        self.target = target
        self.resources = resources
        self.results: list[tuple[str, str | None]] = []  # (kernel, None or the error)
        self.usage: dict[str, tuple[int, int]] = {}  # kernel -> most (registers, spill bytes) over its variants
        self.marked: Counter = Counter()  # kernel -> variants with the miscompile's mark (see the module docstring)

    def run(self, fn: JITFunction, *args, grid, warmup, **kwargs):
        """Specialise the arguments as the JIT does at a launch (integers equal to 1 become constants, pointers and
        multiples of 16 are marked divisible by 16: what lets the compiler vectorise loads), then compile."""
        values = dict(zip(fn.arg_names, args)) | kwargs
        signature, constants, attrs = {}, {}, {}
        for i, p in enumerate(fn.params):
            v = values.get(p.name, p.default)
            if p.is_constexpr or v is None:
                signature[p.name], constants[p.name] = "constexpr", v
                continue
            if isinstance(v, torch.Tensor) and v.dtype not in _TYPES:
                raise TypeError(f"{fn.__name__}: argument {p.name} of dtype {v.dtype}")
            kind, key = native_specialize_impl(BaseBackend, v, False, True, True)
            if kind == "constexpr":
                signature[p.name], constants[p.name] = "constexpr", key
            else:
                signature[p.name] = kind
                if key and "D" in key:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        try:
            compiled = triton.compile(ASTSource(fn, signature, constants, attrs), target=self.target, options=options)
            self.results.append((fn.__name__, None))
            self.marked[fn.__name__] += bool(MARK.search(compiled.asm["ptx"]))
            if self.resources:
                regs, spills = ptxas_usage(compiled.asm["ptx"], self.target.arch)
                old = self.usage.get(fn.__name__, (0, 0))
                self.usage[fn.__name__] = (max(old[0], regs), max(old[1], spills))
        except Exception as exc:  # noqa: BLE001  (every failure is reported, none stops the sweep)
            chain = [exc]  # a compilation error's reason is in the innermost call's error
            while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
                chain.append(chain[-1].__cause__ or chain[-1].__context__)
            self.results.append((fn.__name__, f"{type(exc).__name__}: {exc}\n... innermost: "
                                              f"{type(chain[-1]).__name__}: {str(chain[-1])[-1500:]}"))


MARK = re.compile(r"mul\.wide\.u32\s+%rd\d+, %r\d+, (268435456|536870912|1073741824|2147483648);")


def ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """(registers per thread, spill-store bytes) that the ptxas Triton ships reports for one kernel's PTX."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    regs = max((int(x) for x in re.findall(r"Used (\d+) registers", out)), default=0)
    spills = max((int(x) for x in re.findall(r"(\d+) bytes spill stores", out)), default=0)
    return regs, spills


def drive(quick: bool) -> None:
    """Call the kernels' Python entry points over a sweep of formats (every launch compiles instead)."""
    from kvsqueeze.cache.factory import make_codec
    from kvsqueeze.cache.static import StaticLayerKV
    from kvsqueeze.cache.synthetic import filled_layer, padding_mask, query_for
    from kvsqueeze.kernels import triton_common, triton_decode, triton_pack, triton_static
    from kvsqueeze.spec import preset

    for mod in (triton_common, triton_decode, triton_pack):  # "a GPU is here": the kernels' routes, not the reference
        mod.available = lambda: True
    specs = ["kivi-4"] if quick else ["kivi-4", "kivi-2", "int8", "fp8-e4m3", "rot-3", "k4t64-v4t32-w32",
                                      "kivi-2-sink4", "int4", "int2"]
    dtypes = [torch.bfloat16] if quick else [torch.float32, torch.bfloat16]
    for spec in specs:
        sp = dataclasses.replace(preset(spec), block_tokens=128)
        for dtype in dtypes:
            for pooled in (True,) if quick else (True, False):
                for new in (1, 40):  # decode; prefill on top of the cache (query tiles)
                    layer = filled_layer(sp, batch=2, kv_heads=2, head_dim=64, stored=300, pooled=pooled,
                                         dtype=dtype, new=new)
                    for route in ("0", "1") if new > 1 else ("0",):  # prefill: the tiled kernel, the dense route
                        with mock.patch.dict(os.environ, {"KVSQUEEZE_TRITON_PREFILL_DENSE": route}):
                            triton_decode.attend(query_for(layer, 8, new), layer.plan(), None, 0.125)
                    if new == 1 and pooled:  # the device's failing case (tests/kernels/test_conformance.py "int4
                        # broadcast mask batch"): 64-token blocks, one mask row for a batch of 3, read in place
                        sp64 = dataclasses.replace(sp, block_tokens=max(64, sp.flush_tokens))
                        small = filled_layer(sp64, batch=3, kv_heads=1, head_dim=64, stored=300, pooled=True,
                                             dtype=dtype)
                        triton_decode.attend(query_for(small, 2, 1), small.plan(), padding_mask(small, 1, [17]),
                                             0.125)
            for side in (sp.key, sp.value):
                triton_pack.encode(make_codec(side, 64, dtype).fmt, torch.randn(2, 2, 128, 64).to(dtype))
    for spec in ["k4c16-v4t16-w16-s4"] if quick else ["k4c16-v4t16-w16", "k2c16-v2t32-w32-s4", "fp8-e4m3",
                                                       "k8t32-v8t32"]:
        lay = StaticLayerKV(preset(spec), 112)
        k = torch.randn(2, 2, 37, 64, dtype=torch.bfloat16)
        lay.allocate(k, k)
        lay.stage(k, k)
        lay.commit()
        lay.write_token(k[:, :, :1], k[:, :, :1])
        triton_static.attend(torch.randn(2, 4, 1, 64, dtype=torch.bfloat16), None, 0.125, lay, lay.tensors())
        count, ring_k, ring_v, k_parts, v_parts = lay.split(lay.tensors())
        for side, ring, parts in (("k", ring_k, k_parts), ("v", ring_v, v_parts)):  # the flush, count on the device
            triton_pack.encode_ring(lay.codecs[side].fmt, ring, parts, count, lay.S, lay.W, lay.G, lay.rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (90: H100/H200)")
    p.add_argument("--quick", action="store_true", help="one format per kernel")
    p.add_argument("--resources", action="store_true", help="also print ptxas's registers and spills per kernel")
    p.add_argument("--block-t", type=int, default=None, help="the decode's BLOCK_T (default: the module's)")
    p.add_argument("--num-warps", type=int, default=None, help="the decode's NUM_WARPS (default: the module's)")
    p.add_argument("--launch", default=None, metavar="BT:PROGRAMS:WARPS[:CHUNK[:STAGES]]",
                   help="the decode's whole launch shape (as KVSQUEEZE_TRITON_DECODE)")
    args = p.parse_args(argv)
    from kvsqueeze.kernels import triton_decode

    if args.launch:
        (triton_decode.BLOCK_T, triton_decode.TARGET_PROGRAMS, triton_decode.NUM_WARPS, triton_decode.CHUNK,
         triton_decode.NUM_STAGES) = triton_decode.parse_launch(args.launch)
    triton_decode.BLOCK_T = args.block_t or triton_decode.BLOCK_T
    triton_decode.NUM_WARPS = args.num_warps or triton_decode.NUM_WARPS
    compiler = Compiler(GPUTarget("cuda", args.arch, 32), args.resources)
    original = JITFunction.run
    JITFunction.run = lambda fn, *a, grid, warmup, **kw: compiler.run(fn, *a, grid=grid, warmup=warmup, **kw)
    try:
        drive(args.quick)
    finally:
        JITFunction.run = original
    counts = Counter((name, err is None) for name, err in compiler.results)
    print(f"triton {triton.__version__}, target sm_{args.arch}:")
    for name in sorted({n for n, _ in counts}):
        usage = compiler.usage.get(name)
        extra = f" (at most {usage[0]} registers, {usage[1]} bytes of spill stores)" if usage else ""
        print(f"  {name}: {counts[(name, True)]} compiled, {counts[(name, False)]} failed{extra}, "
              f"{compiler.marked[name]} with the miscompile's mark")
    first = {}
    for name, err in compiler.results:
        if err is not None:
            first.setdefault(name, err)
    for name, err in first.items():
        print(f"\n{name}: {err[:3000]}")
    return 1 if first else 0


if __name__ == "__main__":
    sys.exit(main())
