"""The Triton kernels compile for an H100 (sm_90) on a machine without a GPU: the interpreter, which the other
Triton tests use here, runs the kernels' Python and accepts what the compiler may refuse."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ._helpers import HAS_TRITON, ROOT, script_env


def _tool(name: str) -> bool:
    import triton.backends.nvidia as nvidia

    return (Path(nvidia.__file__).parent / "bin" / name).exists()


def _ptxas() -> bool:
    return _tool("ptxas")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_every_kernel_compiles_for_sm90():
    if not _ptxas():
        pytest.skip("this Triton has no NVIDIA backend compiler (ptxas) to compile with")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "triton_compile_check.py"), "--quick"],
                         capture_output=True, text=True, env=script_env(TRITON_INTERPRET=None), timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    for kernel in ("_partials_kernel", "_finish_kernel", "_prefill_segment_kernel", "_unpack_kernel",
                   "_pack_token_kernel", "_pack_channel_kernel"):
        assert f"{kernel}: " in run.stdout and f"{kernel}: 0 compiled" not in run.stdout, run.stdout


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_the_decode_loop_cost_is_read_from_the_machine_code():
    """benchmarks/decode_loop_cost.py finds the partials kernel's token loop in its SASS and counts it: a row per
    format with registers, a loop of some hundred instructions and a bandwidth ceiling."""
    if not _ptxas() or not _tool("cuobjdump"):
        pytest.skip("this Triton has no NVIDIA backend tools (ptxas, cuobjdump)")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_loop_cost.py"), "--specs", "fp8-e4m3",
                          "--configs", "32:4", "--histogram", "3", "--lines", "4", "--prefill", "64:32:4"],
                         capture_output=True,
                         text=True, env=script_env(TRITON_INTERPRET=None), timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("| fp8-e4m3 | 32 | 4 |"))
    cells = [c.strip() for c in lines[i].strip("|").split("|")]
    regs, loop, per_token, ceiling = int(cells[3]), int(cells[5]), float(cells[6]), float(cells[9])
    assert 0 < regs <= 255 and 50 < loop < 5000 and per_token == pytest.approx(loop * 4 / 32, rel=0.01)
    assert 100 < ceiling < 100000, lines[i]
    # the histogram: three opcodes whose counts are part of the loop's
    counts = [int(part.rsplit(" ", 1)[1]) for part in lines[i + 1].strip().split(", ")]
    assert len(counts) == 3 and 0 < sum(counts) <= loop, lines[i + 1]
    # the source lines that cost the most: four, in falling order, summing to at most the loop, and among them the
    # kernel's dot products (every format's loop multiplies on the matrix units), named by their source text
    rows = [line.split(None, 2) for line in lines[i + 2:i + 6]]
    per_line = [int(r[0]) for r in rows]
    assert per_line == sorted(per_line, reverse=True) and 0 < sum(per_line) <= loop, lines[i + 2:i + 6]
    assert all(re.fullmatch(r"[\w.]+\.py:\d+", r[1]) for r in rows), lines[i + 2:i + 6]
    assert any("triton_common.py" in r[1] and "tl.dot(" in r[2] for r in rows), lines[i + 2:i + 6]
    # the prefill's loop over the packed segment, per token per 128 query rows
    j = next(j for j, line in enumerate(lines) if line.startswith("| fp8-e4m3 | 64 | 32 | 4 |"))
    cells = [c.strip() for c in lines[j].strip("|").split("|")]
    loop = int(cells[6])
    assert 50 < loop < 5000 and float(cells[7]) == pytest.approx(loop * 4 / 32 * 2, rel=0.01), lines[j]
