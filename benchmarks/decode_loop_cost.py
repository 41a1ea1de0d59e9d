"""What one token costs the Triton decode's inner loop, read from its machine code, on a machine without a GPU.

Decode attention over packed K/V should be bound by memory bandwidth; on the H200 (BENCHMARKS section 2, "On a
GPU") it is bound by instructions instead.  This compiles the partials kernel for sm_90 (as
triton_compile_check.py does: specialised as the JIT would, nothing launched) for Llama-shaped heads (head_dim 128,
4 query rows per kv head, bf16), disassembles it with the nvdisasm Triton ships, finds the token loop (the longest
backward branch) and prints, per format and launch shape: registers and spills (ptxas), instructions per loop
iteration per warp, warp-instructions per token, per byte the token stores, and the bandwidth at which issuing
them would be the limit on an H200 (132 SMs x 4 warp-instructions per clock x 1.98 GHz: an upper bound, since
issue slots also stall).  A kernel change that lowers warp-instructions per byte raises that ceiling.

``--histogram N`` adds the loop's N most common opcodes (where the instructions go); ``--lines N`` the N source
lines of the kernels that put the most instructions in the loop (the line info nvdisasm reads from the cubin), each
with its commonest opcodes and its text; ``--prefill BM:BN:WARPS ...``
does the same for the prefill kernel's loop over a packed segment (128 query rows per kv head's program by
default), per token and per 128 query rows: the prefill reads each key/value tile once per query tile, so its
loop's cost is the online softmax over the tile plus unpacking it.

    python benchmarks/decode_loop_cost.py                                   # kivi-4, kivi-2, int8, fp8 x shapes
    python benchmarks/decode_loop_cost.py --specs kivi-4 --configs 32:4 16:1  # BLOCK_T:NUM_WARPS pairs
    python benchmarks/decode_loop_cost.py --specs kivi-4 --configs 32:1 --histogram 12 --prefill 128:64:8
    python benchmarks/decode_loop_cost.py --specs kivi-4 --configs 32:1 --lines 12   # which source lines cost
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run without TRITON_INTERPRET: this reads the compiler's output")

import torch  # noqa: E402
import triton_compile_check as tcc  # noqa: E402  (a sibling script: its folder is sys.path[0] when run)

ISSUE_PER_S = 132 * 4 * 1.98e9  # H200: SMs x warp-instructions per clock x boost clock


_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def loop_instructions(cubin: bytes) -> list[tuple[str, str]]:
    """(opcode, source "file:line") of each instruction of the longest loop (from a backward branch's target to the
    branch) in a kernel's SASS, disassembled with the line info the cubin carries (the nvdisasm Triton ships)."""
    from triton.backends.nvidia.compiler import get_ptxas

    nvdisasm = Path(get_ptxas(90).path).with_name("nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([str(nvdisasm), "-g", "-c", str(path)], capture_output=True, text=True,
                              check=True).stdout.splitlines()
    rows, labels, branches, source = [], {}, [], "?"
    for line in sass:
        if m := re.search(r'//## File "([^"]+)", line (\d+)', line):
            source = f"{Path(m.group(1)).name}:{m.group(2)}"
        elif m := re.match(r"\s*\.L_x_(\d+):", line):
            labels[m.group(1)] = None  # the address of the next instruction
        elif m := _INSTRUCTION.match(line):
            here = int(m.group(1), 16)
            for name in [k for k, v in labels.items() if v is None]:
                labels[name] = here
            rows.append((here, m.group(2), source))
            if b := re.search(r"\bBRA\s+`?\(?\.L_x_(\d+)", line):
                branches.append((here, b.group(1)))
    span = (0, -1)
    for here, label in branches:
        target = labels.get(label)
        if target is not None and target < here and here - target > span[1] - span[0]:
            span = (target, here)
    return [(op, src) for at, op, src in rows if span[0] <= at <= span[1]]


def source_lines(instructions: list[tuple[str, str]], top: int) -> list[str]:
    """The ``top`` source lines with the most of the loop's instructions: count, file:line, commonest opcodes, text."""
    kernels = Path(__file__).resolve().parent.parent / "src" / "kvsqueeze" / "kernels"
    by_line: dict[str, Counter] = {}
    for op, src in instructions:
        by_line.setdefault(src, Counter())[op] += 1
    out = []
    for src, ops in sorted(by_line.items(), key=lambda kv: -sum(kv[1].values()))[:top]:
        name, _, number = src.partition(":")
        file = kernels / name
        text = file.read_text().splitlines()[int(number) - 1].strip() if file.is_file() and number.isdigit() else ""
        common = ", ".join(f"{op} {n}" for op, n in ops.most_common(3))
        out.append(f"    {sum(ops.values()):5d}  {src:22s} {common:52s} {text[:70]}")
    return out


def compile_step(layer, new: int) -> tuple[tcc.Compiler, dict]:
    """Every kernel one attention step of ``new`` query tokens over ``layer`` launches, compiled for sm_90 (nothing
    launched): the compiler (errors, ptxas registers and spills) and each kernel's first compilation by name (a
    prefill step's first is its packed segment's launch)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    from kvsqueeze.cache.synthetic import query_for
    from kvsqueeze.kernels import triton_decode

    compiler, first = tcc.Compiler(GPUTarget("cuda", 90, 32), resources=True), {}
    real_compile, real_run = tcc.triton.compile, JITFunction.run

    def keep(src, target=None, options=None):
        kernel = real_compile(src, target=target, options=options)
        first.setdefault(src.name, kernel)
        return kernel

    tcc.triton.compile = keep
    JITFunction.run = lambda fn, *a, grid, warmup, **kw: compiler.run(fn, *a, grid=grid, warmup=warmup, **kw)
    try:
        triton_decode.attend(query_for(layer, 8, new), layer.plan(), None, 0.125)
    finally:
        tcc.triton.compile, JITFunction.run = real_compile, real_run
    return compiler, first


def kernel_loop(layer, new: int, kernel: str) -> tuple[int, int, list[tuple[str, str]]] | str:
    """(registers, spill bytes, the loop's (opcode, source line) pairs) of ``kernel`` as one attention step of ``new`` query tokens over
    ``layer`` compiles it for sm_90, or the first compile error."""
    compiler, first = compile_step(layer, new)
    errors = [e for _, e in compiler.results if e]
    if errors:
        return errors[0][:200]
    regs, spills = compiler.usage[kernel]
    return regs, spills, loop_instructions(first[kernel].asm["cubin"])


def _histogram(instructions: list[tuple[str, str]], top: int, lines: int) -> None:
    if top:
        ops = Counter(op for op, _ in instructions)
        print("    " + ", ".join(f"{op} {n}" for op, n in ops.most_common(top)))
    if lines:
        print("\n".join(source_lines(instructions, lines)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--specs", nargs="+", default=["kivi-4", "kivi-2", "int8", "fp8-e4m3"])
    p.add_argument("--configs", nargs="+", default=["32:4", "32:2", "16:1", "64:4"], metavar="BLOCK_T:NUM_WARPS")
    p.add_argument("--histogram", type=int, default=0, metavar="N", help="print the loop's N most common opcodes")
    p.add_argument("--lines", type=int, default=0, metavar="N",
                   help="print the N source lines that put the most instructions in the loop")
    p.add_argument("--prefill", nargs="*", default=[], metavar="BM:BN:WARPS",
                   help="also the prefill kernel's loop at these launch shapes")
    args = p.parse_args(argv)
    import triton

    from kvsqueeze.cache.synthetic import filled_layer
    from kvsqueeze.kernels import triton_common, triton_decode, triton_pack, triton_prefill
    from kvsqueeze.spec import preset

    for mod in (triton_common, triton_decode, triton_pack):  # "a GPU is here": the kernels' routes
        mod.available = lambda: True
    print(f"triton {triton.__version__}, sm_90, head_dim 128, 4 query rows per kv head, bf16\n")
    print("| format | BLOCK_T | warps | registers | spill bytes | loop instr / warp | warp-instr / token | "
          "bytes / token | warp-instr / byte | issue-bound GB/s (H200) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for spec in args.specs:
        sp = dataclasses.replace(preset(spec), block_tokens=128)
        layer = filled_layer(sp, batch=1, kv_heads=2, head_dim=128, stored=300, pooled=True,
                             dtype=torch.bfloat16, new=1)
        nb = layer.nbytes()  # bytes of one stored token of one kv head, keys and values (codes + parameters)
        per_token = (nb["codes"] + nb["params"]) * 2 * 128 / nb["quantized_elements"]
        for cfg in args.configs:
            bt, warps = (int(x) for x in cfg.split(":"))
            triton_decode.BLOCK_T, triton_decode.NUM_WARPS = bt, warps
            got = kernel_loop(layer, 1, "_partials_kernel")
            if isinstance(got, str):
                print(f"| {spec} | {bt} | {warps} | compile failed: {got} |")
                continue
            regs, spills, ops = got
            n = len(ops)
            wpt = n * warps / bt
            print(f"| {spec} | {bt} | {warps} | {regs} | {spills} | {n} | {wpt:.1f} | {per_token:.0f} | "
                  f"{wpt / per_token:.2f} | {ISSUE_PER_S / (wpt / per_token) / 1e9:.0f} |")
            _histogram(ops, args.histogram, args.lines)
    if args.prefill:
        print("\nprefill over a packed segment (a program: BM query rows of one kv head, tiles of BN tokens)\n")
        print("| format | BM | BN | warps | registers | spill bytes | loop instr / warp | warp-instr / token / 128 rows |")
        print("|---|---|---|---|---|---|---|---|")
    for spec in args.specs if args.prefill else ():
        layer = filled_layer(dataclasses.replace(preset(spec), block_tokens=128), batch=1, kv_heads=2, head_dim=128,
                             stored=300, pooled=True, dtype=torch.bfloat16, new=40)
        for cfg in args.prefill:
            bm, bn, warps = (int(x) for x in cfg.split(":"))
            triton_prefill.BLOCK_M, triton_prefill.BLOCK_N, triton_prefill.NUM_WARPS = bm, bn, warps
            got = kernel_loop(layer, 40, "_prefill_segment_kernel")
            if isinstance(got, str):
                print(f"| {spec} | {bm} | {bn} | {warps} | compile failed: {got} |")
                continue
            regs, spills, ops = got
            n = len(ops)
            print(f"| {spec} | {bm} | {bn} | {warps} | {regs} | {spills} | {n} | {n * warps / bn * 128 / bm:.0f} |")
            _histogram(ops, args.histogram, args.lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
