"""Threads, each generating greedily with its own QuantizedCache on one shared model, give what the same runs
give one after another (caches of different presets, the reference and the C++ kernel paths, a DynamicCache run
beside them).  A forward step routes the shared model's attention through kvsqueeze and back
(kvsqueeze.adapter): concurrent steps must neither undo each other's routing nor leave it behind."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvsqueeze import QuantizedCache
from kvsqueeze.adapter import cache_kwargs
from kvsqueeze.kernels import cpu
from kvsqueeze.spec import CacheSpec, QuantSpec

from ._counts import record

ROUNDS = 2  # each round starts the threads together; a broken interleaving showed in the first round
NEW_TOKENS = 16
KIVI = CacheSpec(key=QuantSpec(bits=4, axis="channel", group=8), value=QuantSpec(bits=4, axis="token", group=32),
                 window=8, sinks=2, block_tokens=16, name="kivi-4-w8-s2")


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.float32).eval().requires_grad_(False)


def _cpp() -> str | None:
    """The C++ kernel backend where it builds here (as tests/kernels decides), else None."""
    return "cpu" if cpu.available() and cpu.load_extension() is not None else None


def _jobs() -> list[tuple[str, object, str]]:
    """(label, cache spec or None for DynamicCache, backend) of the concurrent runs."""
    jobs = [("kivi reference", KIVI, "torch"), ("int8 reference", "k8t32-v8t32", "torch"), ("dynamic", None, "")]
    if _cpp():
        jobs.append(("kivi c++", KIVI, "cpu"))
    return jobs


def _run(model, spec, backend: str, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 128, (2, 20 + seed % 7), generator=g)
    cache = DynamicCache(config=model.config) if spec is None else QuantizedCache(model.config, spec, backend=backend)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, **cache_kwargs(model, cache))
    return out.tolist()


def _concurrent(model, jobs) -> list:
    """Every job in its own thread, all released together; results in job order (errors re-raised here)."""
    results: list = [None] * len(jobs)
    errors: list[str] = []
    start = threading.Barrier(len(jobs))

    def work(i: int, spec, backend: str) -> None:
        start.wait()
        try:
            results[i] = _run(model, spec, backend, i)
        except BaseException as exc:  # reported by the main thread
            errors.append(f"{jobs[i][0]}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(i, spec, backend)) for i, (_, spec, backend) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def test_threads_with_their_own_caches_equal_serial_runs(model):
    jobs = _jobs()
    serial = [_run(model, spec, backend, i) for i, (_, spec, backend) in enumerate(jobs)]
    impl = model.config._attn_implementation
    for _ in range(ROUNDS):
        for (label, _, _), got, want in zip(jobs, _concurrent(model, jobs), serial):
            assert got == want, f"{label}: a concurrent run differs from the serial one"
            record("threads", f"equal to serial ({label})")
        # no routing is left behind once every step is done
        assert model.config._attn_implementation == impl
