"""Capacity projections: budgets parse strictly, cache bytes of a random fill equal a real prefill's, and the
arithmetic follows the stated model."""

from __future__ import annotations

import pytest
import torch

from kvsqueeze.eval import capacity as cap
from kvsqueeze.eval.peers import footprint, make_cache, prefill


@pytest.mark.parametrize("text,value", [("2GiB", 2 * 2**30), ("1.5 GB", 1_500_000_000), ("512mib", 512 * 2**20),
                                        ("4096", 4096), ("2G", 2 * 10**9), ("3Gi", 3 * 2**30)])
def test_budgets_parse(text, value):
    assert cap.parse_budget(text) == value


@pytest.mark.parametrize("text", ["0", "-1GiB", "two gigs", "", "1 XB", "0.1"])
def test_bad_budgets_are_refused(text):
    with pytest.raises(ValueError, match="budget"):
        cap.parse_budget(text)


@pytest.mark.parametrize("kv", ["kivi-2", "k2c16-v2t16-w16-s2", "full", "hf-quanto-int4"])
def test_random_fill_holds_the_bytes_of_a_real_prefill(tiny_llama, kv):
    ids = torch.randint(2, 256, (1, 300), generator=torch.Generator().manual_seed(0))
    real = make_cache(tiny_llama, kv)
    prefill(tiny_llama, ids, real, chunk=128)
    assert cap.cache_bytes(tiny_llama, kv, 300, chunk=128) == footprint(real).total


def test_cost_is_exact_for_the_quantized_part(tiny_llama):
    """The per-token bytes are the difference of two exact fills; at full precision they are 2 layers x 2 KV heads
    x 64 dims x (K, V) x 4 bytes, with nothing fixed."""
    cost = cap.cache_cost(tiny_llama, "kivi-2", short=512, long=1024)
    q = cap.cache_bytes(tiny_llama, "kivi-2", 1024) - cap.cache_bytes(tiny_llama, "kivi-2", 512)
    assert cost["bytes_per_token"] == q / 512
    full = cap.cache_cost(tiny_llama, "full", short=512, long=1024)
    assert full["bytes_per_token"] == 2 * 2 * 64 * 2 * 4 and full["fixed_bytes"] == 0


def test_capacity_arithmetic():
    cost = {"fixed_bytes": 10.0, "bytes_per_token": 2.0}
    c = cap.capacity(cost, 90.0, 1000, max_positions=300, batch_context=100)
    assert c["max_tokens"] == 450 and c["max_context"] == 300 and c["limited_by_model_positions"]
    assert c["bytes_per_sequence"] == 300 and c["max_batch"] == 3
    assert cap.capacity(cost, 2000.0, 1000, None)["max_tokens"] == 0  # the transient alone is over budget
    measured = {"batch": 3, "context": 100, "peak_rss_delta_bytes": 990}
    assert cap.check_projection(cost, 90.0, measured)["ratio"] == pytest.approx(990 / 900)


def test_a_gpu_run_measures_its_transient_in_gpu_memory():
    """On a GPU the budget is GPU memory: the transient comes from CUDA's peak allocated, not the process's RSS."""
    cpu_run = {"batch": 2, "peak_rss_delta_bytes": 1000, "cuda_peak_allocated_delta_bytes": None,
               "kv_bytes": {"total": 400}}
    gpu_run = dict(cpu_run, cuda_peak_allocated_delta_bytes=3000)
    assert cap.transient_per_sequence(cpu_run) == 300 and cap.transient_per_sequence(gpu_run) == 1300
    cost = {"fixed_bytes": 0.0, "bytes_per_token": 1.0}
    assert cap.check_projection(cost, 0.0, dict(gpu_run, context=1000))["measured_peak_bytes"] == 3000
