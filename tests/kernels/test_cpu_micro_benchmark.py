"""The CPU section of benchmarks/attention_micro.py (the GPU sections: test_gpu_benchmark_dry_run.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvsqueeze.kernels import cpu

from ._helpers import ROOT, script_env


@pytest.mark.skipif(not cpu.available(), reason="C++ kernel could not be built here")
def test_micro_benchmark_times_both_orders_over_arena_blocks():
    """benchmarks/attention_micro.py --arena --orders: the CPU table has a row per preset and order, each against
    the same order's full."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention_micro.py"), "--threads", "1",
                          "--layers", "2", "--contexts", "600", "--reps", "1", "--presets", "full", "kivi-4",
                          "--isa", cpu.runnable_isas()[0], "--arena", "--orders", "chunks", "heads",
                          "--prefill-tokens", "0"], capture_output=True, text=True, env=script_env(), timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line.split(" | ") for line in run.stdout.splitlines() if line.startswith("| 1 | 600 | kvsqueeze")]
    assert sorted(r[2] for r in rows) == ["kvsqueeze full", "kvsqueeze full (heads order)", "kvsqueeze kivi-4",
                                          "kvsqueeze kivi-4 (heads order)"]
    assert all(r[-1].strip(" |") == "1.00x" for r in rows if r[2].startswith("kvsqueeze full"))
    assert all(float(r[4]) > 0 for r in rows)
