"""The Triton kernels compile for an H100 (sm_90) on a machine without a GPU: the interpreter, which the other
Triton tests use here, runs the kernels' Python and accepts what the compiler may refuse."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ._helpers import HAS_TRITON

ROOT = Path(__file__).resolve().parents[2]


def _ptxas() -> bool:
    import triton.backends.nvidia as nvidia

    return (Path(nvidia.__file__).parent / "bin" / "ptxas").exists()


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_every_kernel_compiles_for_sm90():
    if not _ptxas():
        pytest.skip("this Triton has no NVIDIA backend compiler (ptxas) to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "triton_compile_check.py"), "--quick"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    for kernel in ("_partials_kernel", "_finish_kernel", "_prefill_segment_kernel", "_pack_token_kernel",
                   "_pack_channel_kernel"):
        assert f"{kernel}: " in run.stdout and f"{kernel}: 0 compiled" not in run.stdout, run.stdout
