"""The static cache's Triton decode (kernels/triton_static.py): every launch argument fixed, the step's counts read on
the device, the window read from the ring; the same outputs as the reference over the layer's plan, step after
step across flushes and ring wraps (under TRITON_INTERPRET=1 here)."""

from __future__ import annotations

import copy

import pytest
import torch

import kvsqueeze
from kvsqueeze.cache.static import StaticLayerKV
from kvsqueeze.kernels import reference
from kvsqueeze.spec import preset

from ._helpers import HAS_TRITON, TRITON_DEVICE, require_triton_runtime

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package")

# (spec, padding mask, prompt tokens): per-channel keys with a window, 2-bit with sinks (and a prompt shorter than
# the sinks: decode steps write them), per-token 8-bit, fp8
CASES = [("k4c16-v4t16-w16", True, 37), ("k2c16-v2t32-w32-s4", False, 37), ("k4c16-v4t16-w16-s4", True, 2),
         ("k8t32-v8t32", False, 37), ("fp8-e4m3", False, 37)]


def _steps(spec: str, mask: bool, prompt: int) -> None:
    from kvsqueeze.kernels import triton_static

    require_triton_runtime()
    g = torch.Generator().manual_seed(0)
    b, hkv, hq, d, max_len = 2, 2, 4, 32, 112
    layer = StaticLayerKV(preset(spec), max_len)

    def kv(n):
        return [torch.randn(b, hkv, n, d, generator=g).to(TRITON_DEVICE) for _ in range(2)]

    k, v = kv(prompt)
    layer.allocate(k, v)
    layer.stage(k, v)
    layer.commit()
    cols = torch.ones(b, 1, 1, layer.max_len, dtype=torch.bool, device=TRITON_DEVICE)
    cols[1, ..., 1:3] = False  # two of the second row's positions are hidden (among the sinks where there are)
    for step in range(28):  # past flushes of the group and a wrap of the ring (48 slots for the first spec)
        k, v = kv(1)
        layer.write_token(k, v)
        q = torch.randn(b, hq, 1, d, generator=g).to(TRITON_DEVICE)
        m = cols if mask else None
        got = triton_static.attend(q, m, 0.2, layer, layer.tensors())
        want = reference.attend(q, layer.plan_from(layer.tensors(), 1), m, 0.2)
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-5), (step, (got - want).abs().max())
        layer.flush()


@pytest.mark.parametrize("spec,mask,prompt", CASES)
def test_matches_the_reference_step_after_step(spec, mask, prompt):
    _steps(spec, mask, prompt)


def test_a_compiled_model_takes_the_graphed_operator(tiny_llama):
    """backend='triton': the decode step goes through static_attend_graphed (nothing read on the host), traced whole
    (fullgraph), with the reference backend's logits."""
    require_triton_runtime()
    from kvsqueeze.adapter import StaticQuantizedCache, attention_paths, cache_kwargs

    model = copy.deepcopy(tiny_llama).to(TRITON_DEVICE)  # the session's fixture stays on the CPU for other tests
    prompt = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(5)).to(TRITON_DEVICE)
    spec = "k4c16-v4t16-w16"
    outs = []
    for backend, step in (("torch", model), ("triton", torch.compile(model, backend="aot_eager", fullgraph=True))):
        cache = StaticQuantizedCache(model.config, spec, 64, backend=backend)
        logits = []
        with torch.no_grad(), kvsqueeze.patch(model):
            out = model(input_ids=prompt, **cache_kwargs(model, cache)).logits
            for _ in range(6):
                out = step(input_ids=out[:, -1:].argmax(-1), **cache_kwargs(model, cache)).logits
                logits.append(out[:, -1])
        outs.append(torch.stack(logits))
        if backend == "triton":
            assert cache.layers[0].kv.graphed and "triton-static" in attention_paths(cache)
    assert torch.allclose(outs[0], outs[1], atol=1e-4), (outs[0] - outs[1]).abs().max()


@pytest.mark.parametrize("spec", ["k4c16-v2t16-w16-s4", "k8t32-v4c32-w32"])
def test_the_ring_flush_by_the_triton_pack_writes_the_torch_codecs_bytes(spec, monkeypatch):
    """On a GPU a static layer's flush is one Triton pack per side reading the ring and the count on the device
    (adapter.ring_encoder): step after step, across flushes and ring wraps, every stored byte equals the torch
    codec's flush."""
    require_triton_runtime()
    from kvsqueeze.adapter import ring_encoder

    monkeypatch.setenv("KVSQUEEZE_TRITON_ENCODE", "1")  # the CPU under the interpreter too
    g = torch.Generator().manual_seed(3)
    layers = [StaticLayerKV(preset(spec), 120) for _ in range(2)]
    kv = [torch.randn(2, 2, 40, 32, generator=g).to(TRITON_DEVICE) for _ in range(2)]
    for lay in layers:
        lay.allocate(*kv)
        lay.stage(*kv)
        lay.commit()
    calls = []
    layers[0].ring_encode = lambda *a: calls.append(ring_encoder(*a)) or calls[-1]
    for _ in range(70):  # several groups of 16 or 32 tokens, the ring wrapping
        step = [torch.randn(2, 2, 1, 32, generator=g).to(TRITON_DEVICE) for _ in range(2)]
        for lay in layers:
            lay.write_token(*step)
            lay.flush()
    # (a CPU flushes only the steps that complete a group; a GPU every step) both sides, none handed back
    assert len(calls) >= 4 and all(calls)
    for name, t in layers[1].parts.items():
        assert torch.equal(layers[0].parts[name], t), name
