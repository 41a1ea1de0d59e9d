"""The GPU sections of benchmarks/attention_micro.py run end to end on the CPU under Triton's interpreter
(``--gpu-dry-run``), so a GPU call never finds the benchmark's own code broken: the table has the SDPA row and a
checked, timed row per format and launch shape, the prefill table its rows."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ._helpers import HAS_TRITON, ROOT, script_env


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_the_gpu_sections_run_dry_on_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run the benchmark itself")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention_micro.py"), "--skip-cpu",
                          "--gpu-dry-run", "--gpu-contexts", "200", "--gpu-batch", "1", "--gpu-kv-heads", "8",
                          "--gpu-presets", "kivi-4", "--gpu-configs", "32:1024:4", "16:4096:1", "--gpu-graphs",
                          "--reps", "1", "--prefill-tokens", "20", "--prefill-contexts", "200",
                          "--prefill-routes", "tiled", "dense", "--no-prefill-reference"], capture_output=True, text=True,
                         env=script_env(TRITON_INTERPRET="1"), timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "DRY RUN" in out and "| 32/8 | 1 | 200 | SDPA bf16 |" in out
    for cfg in ("bt32 p1024 w4 c256", "bt16 p4096 w1 c256"):
        row = next(line for line in out.splitlines() if f"| fused kivi-4 {cfg} |" in line)
        assert float(row.split("|")[5]) > 0, row  # checked against the reference, then timed
    assert "WRONG" not in out and "FAILED" not in out
    for p in ("kivi-4", "kivi-2"):  # the prefill's two routes, each named by the path it took
        assert f"| 200 | triton prefill {p} (triton-prefill) |" in out, out
        assert f"| 200 | triton prefill {p} (triton-prefill-dense) |" in out, out
