"""Every attention kernel path against the reference over one table of cases.

Paths: the C++ kernel on each instruction-set path this CPU runs (decode, and its multi-query path for steps of more
than ``cpu.MAX_QUERIES`` tokens), and the Triton kernels (decode, and prefill past ``MAX_QUERIES``) over a pooled
cache and over separate blocks - on the GPU when there is one, else under ``TRITON_INTERPRET=1`` with small tiles.
Cases: every format, block / window / sink boundaries, head dims 32-256, GQA and MQA, bool and float masks (with
fully masked rows and a broadcast batch dim), sliding layers after eviction, fp16 / bf16 models.

Tolerance (``_helpers.assert_matches_reference``): atol 5e-5 on these O(1) outputs (float32 accumulation in
another order), INT_DOT_ATOL where the C++ kernel scores keys with integer dot products, 2e-2 relative for fp16 /
bf16 models (the dtype's output rounding).  The Triton paths take the cases ``_triton_serves`` names (not a
head_dim that is not a power of two, and a subset of the boundary sweep: the interpreter is slow) and must really
serve them, not hand them to the reference.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch

from kvsqueeze.kernels import cpu
from kvsqueeze.spec import preset

from ._helpers import (
    HAS_TRITON,
    TRITON_DEVICE,
    assert_matches_reference,
    filled_layer,
    padding_mask,
    query_for,
    require_triton_runtime,
)


class Case(NamedTuple):
    spec: str
    batch: int = 2
    kv_heads: int = 2
    q_heads: int = 6
    head_dim: int = 64
    stored: int = 300
    new: int = 1
    steps: int = 4
    mask: str = "none"  # none | padding | float | dead-row | broadcast | sliding
    dtype: torch.dtype = torch.float32
    sliding: int | None = None
    triton: bool = True  # also through the Triton paths (the interpreter is slow: boundaries sweep the C++ only)


FORMATS = ["full", "int8", "int4", "int2", "kivi-4", "kivi-3", "kivi-2", "kivi-2-sink4", "fp8-e4m3", "fp8-e5m2",
           "k1c32-v1t32-w64-s3", "k8t16-v3c16-w32", "k1t4-v2t2", "k4c16-v8t8-w16-s1", "k2t32-v4c64-w64", "rot-3",
           "k2.75r-v2.75r-w64-s3", "k3rc32-v2.375rc32-w64-s3"]

CASES: dict[str, Case] = {}
for _s in FORMATS:
    CASES[f"{_s} gqa padding"] = Case(_s, mask="padding")
    CASES[f"{_s} 3 new"] = Case(_s, new=3)
# 3-bit codes are read through the 4-bit paths (repacked per work item): symmetric ones shifted onto the 4-bit
# centre, per-token keys of one group per row (the integer key path), values whose groups span 8 packing units
SYM3 = ('{"key": {"fmt": "int", "bits": 3, "axis": "channel", "group": 32, "symmetric": true}, "value": {"fmt": '
        '"int", "bits": 3, "axis": "token", "group": 16, "symmetric": true}, "window": 32, "sinks": 2}')
for _s in (SYM3, "k3t-v3t16", "k3t64-v3c32-w32"):
    CASES[f"{_s} gqa padding"] = Case(_s, mask="padding")
    CASES[f"{_s} 3 new"] = Case(_s, new=3)
for _s in ("k3t-v3t32", "kivi-3"):
    CASES[f"{_s} head_dim 128"] = Case(_s, batch=1, q_heads=2, head_dim=128, steps=1)
for _s in ("k3t-v3t8", "k3c32-v3t8-w32"):  # a head_dim the kernel is not compiled for: the generic 3-bit unpacking
    CASES[f"{_s} head_dim 40"] = Case(_s, batch=1, q_heads=2, head_dim=40, steps=1, triton=False)
CASES["kivi-3 gemma shape"] = Case("kivi-3", kv_heads=1, q_heads=4, head_dim=256, stored=333, steps=2)
for _s in ("kivi-4", "kivi-2-sink4", "int8", "rot-3", "kivi-3"):
    CASES[f"{_s} prefill 20 over history"] = Case(_s, new=20, mask="padding", stored=200)
CASES["kivi-4 prefill fully masked row"] = Case("kivi-4", new=20, stored=200, mask="dead-row")
CASES["int4 prefill float mask"] = Case("int4", q_heads=4, new=20, stored=200, mask="float")
for _n in (1, 3, 31, 32, 33, 127, 128, 129, 160, 161, 257, 300):
    for _s in ("kivi-2-sink4", "int4", "k3c32-v3t32-w32-s5"):
        CASES[f"{_s} {_n} stored"] = Case(_s, batch=1, kv_heads=1, q_heads=4, stored=_n, steps=min(_n, 3),
                                          triton=_n in (1, 33, 129, 257))
for _d in (32, 40, 128, 256):
    for _s in ("full", "k4c32-v4t8-w32", "k8t8-v2t8", "fp8-e4m3", "k1c32-v1t8"):
        CASES[f"{_s} head_dim {_d}"] = Case(_s, batch=1, q_heads=2, head_dim=_d, steps=1,
                                            triton=_d != 256 or _s == "full")
for _s in ("full", "int8", "kivi-4", "kivi-2-sink4"):  # Gemma-3's heads: 1 KV head, 4 query heads, head_dim 256
    CASES[f"{_s} gemma shape"] = Case(_s, kv_heads=1, q_heads=4, head_dim=256, stored=333, steps=2)
CASES["kivi-4 float mask"] = Case("kivi-4", q_heads=4, stored=400, new=2, steps=1, mask="float")
CASES["kivi-4 fully masked row"] = Case("kivi-4", q_heads=4, stored=400, new=2, steps=1, mask="dead-row")
CASES["int4 broadcast mask batch"] = Case("int4", batch=3, kv_heads=1, q_heads=2, steps=1, mask="broadcast")
for _s in ("full", "kivi-2", "k4c32-v4t32-w32"):
    CASES[f"{_s} sliding after eviction"] = Case(_s, batch=1, q_heads=4, stored=900, steps=40, sliding=96,
                                                 mask="sliding")
    CASES[f"{_s} sliding after eviction, no mask"] = Case(_s, batch=1, q_heads=4, stored=900, steps=40, sliding=96)
for _dt in (torch.float16, torch.bfloat16):  # (on a GPU 2- and 4-bit codes then take triton_common's codes16)
    for _s in ("full", "kivi-4", "fp8-e5m2", "kivi-2", "int4", "k2t8-v4t4-w16"):
        CASES[f"{_s} {str(_dt)[6:]} model"] = Case(_s, batch=1, q_heads=4, steps=1, dtype=_dt)


def _mask(layer, case: Case) -> torch.Tensor | None:
    if case.mask == "none":
        return None
    if case.mask in ("padding", "dead-row"):
        m = padding_mask(layer, case.new, [0, 45] if case.mask == "padding" else [0, 10])
        if case.mask == "dead-row":
            m[1] = False  # sequence 1 sees nothing: its rows must come out 0
        return m
    if case.mask == "float":
        m = torch.zeros(padding_mask(layer, case.new, [0, 10]).shape, device=layer.store.device)
        m = m.masked_fill(~padding_mask(layer, case.new, [0, 10]), float("-inf"))
        m[0, ..., 5:9] += 0.7  # a real additive bias
        return m
    if case.mask == "broadcast":
        return padding_mask(layer, case.new, [17])
    kv_len = layer.n_total - layer.first_visible + case.new  # sliding: the layer's window over positions
    cols = torch.arange(kv_len) + layer.first_visible
    qpos = layer.n_total
    return ((cols > qpos - case.sliding) & (cols <= qpos))[None, None, None, :].to(layer.store.device)


class KernelPath(NamedTuple):
    name: str
    attend: object
    device: str
    pooled: bool | None


# triton-pool / triton-blocks: prefill steps on the tiled kernel; triton-dense: on the dense route (unpacked once,
# then SDPA; triton_prefill.dense), over a pool
PATHS = [*(f"cpu-{isa}" for isa in cpu.ISAS), "triton-pool", "triton-blocks", "triton-dense"]


def _triton_serves(case: Case) -> bool:
    """What the Triton kernels take (the rest goes to the reference: a head_dim that is not a power of two)."""
    return case.triton and not case.head_dim & (case.head_dim - 1)


def _takes(path: str, name: str) -> bool:
    if path.startswith("cpu"):
        return True
    if path == "triton-dense":  # a prefill route: the cases of more than MAX_QUERIES new tokens
        return _triton_serves(CASES[name]) and "prefill" in name
    # block by block is the fallback of caches without a pool: formats, prefill and eviction are enough there
    return _triton_serves(CASES[name]) and (path == "triton-pool" or any(
        k in name for k in ("gqa padding", "prefill", "sliding")))


PAIRS = [(p, c) for p in PATHS for c in CASES if _takes(p, c)]


@pytest.fixture
def kernel(request, monkeypatch):
    name = request.param
    if name.startswith("cpu-"):
        isa = name[4:]
        if not cpu.available():
            pytest.skip("C++ kernel could not be built here")
        if isa not in cpu.runnable_isas():
            pytest.skip(f"this CPU cannot run the C++ kernel's {isa} path")
        with cpu.use_isa(isa):
            if cpu.load_extension() is None:
                pytest.fail(f"the C++ kernel's {isa} build failed: {cpu._failed.get(isa)}")
            yield KernelPath(name, cpu.attend, "cpu", None)
        return
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from kvsqueeze.kernels import triton_decode, triton_prefill

    require_triton_runtime()
    if TRITON_DEVICE == "cpu":  # interpreted: small tiles, so a few hundred tokens span many of them
        for mod, names in ((triton_decode, ("CHUNK", "BLOCK_T")),
                           (triton_prefill, ("BLOCK_M", "BLOCK_N", "UNPACK_T"))):
            for attr in names:
                monkeypatch.setattr(mod, attr, 64 if attr == "CHUNK" else 32)
    monkeypatch.setenv("KVSQUEEZE_TRITON_PREFILL_DENSE", "1" if name == "triton-dense" else "0")
    yield KernelPath(name, triton_decode.attend, TRITON_DEVICE, name != "triton-blocks")


def _layer(case: Case, path: KernelPath):
    spec = preset(case.spec)
    if path.pooled:  # small blocks: the pool grows and the table spans many slots
        spec = dataclasses.replace(spec, block_tokens=max(64, spec.flush_tokens))
    return filled_layer(spec, batch=case.batch, kv_heads=case.kv_heads, head_dim=case.head_dim, stored=case.stored,
                        new=case.new, steps=case.steps, dtype=case.dtype, sliding=case.sliding, device=path.device,
                        pooled=path.pooled)


@pytest.mark.parametrize("kernel,case", PAIRS, ids=[f"{p}-{c}" for p, c in PAIRS], indirect=["kernel"])
def test_kernel_matches_reference(kernel, case):
    c = CASES[case]
    layer = _layer(c, kernel)
    if kernel.name.startswith("triton"):  # the case is really on a Triton kernel, not handed to the reference
        from kvsqueeze.kernels import triton_decode

        assert triton_decode.path(query_for(layer, c.q_heads, c.new), layer.plan()) != "reference"
    mask = _mask(layer, c)
    if c.dtype != torch.float32:
        atol = 2e-2
    else:
        atol = None if kernel.name.startswith("cpu") else 1e-4
    assert_matches_reference(kernel.attend, layer, c.q_heads, c.new, mask, atol=atol)
    if c.mask == "dead-row":
        q = query_for(layer, c.q_heads, c.new)
        assert kernel.attend(q, layer.plan(), mask, 0.125)[1].abs().max() == 0
