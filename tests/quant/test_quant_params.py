"""Directed rounding of parameters to their storage dtype."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsqueeze.quant import PARAM_TORCH_DTYPES, param_torch_dtype, scale_floor, to_param

NARROW = ["fp16", "bf16", "fp8-e4m3"]


@settings(max_examples=60, deadline=None)
@given(pd=st.sampled_from(NARROW + ["fp32"]), seed=st.integers(0, 2**31 - 1), logmag=st.integers(-40, 20))
def test_directed_rounding_brackets_and_is_tight(pd: str, seed: int, logmag: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(257, generator=gen) * 2.0**logmag
    t[0], t[1] = 0.0, -0.0
    lim = torch.finfo(param_torch_dtype(pd)).max
    tc = t.clamp(-lim, lim)
    up, down, near = (to_param(t, pd, m) for m in ("up", "down", "nearest"))
    for r in (up, down, near):
        assert r.dtype == PARAM_TORCH_DTYPES[pd]
        assert torch.isfinite(r.float()).all()
    assert (up.float() >= tc).all() and (down.float() <= tc).all()
    # tight: round-to-nearest picks one of the two directed results, and representable values are fixed points
    assert ((near.float() == up.float()) | (near.float() == down.float())).all()
    assert torch.equal(to_param(up.float(), pd, "down").float(), up.float())
    assert torch.equal(to_param(down.float(), pd, "up").float(), down.float())


@pytest.mark.parametrize("pd", NARROW + ["fp32"])
def test_scale_floor_is_positive_and_representable(pd: str) -> None:
    f = scale_floor(pd)
    assert f > 0
    assert torch.tensor(f).to(param_torch_dtype(pd)).float().item() == f


def test_clamps_to_fp8_range() -> None:
    r = to_param(torch.tensor([1e4, -1e4, 447.0]), "fp8-e4m3", "up")
    assert r.float().tolist() == [448.0, -448.0, 448.0]


def test_unknown_names_raise() -> None:
    with pytest.raises(ValueError, match="allowed"):
        param_torch_dtype("fp64")
    with pytest.raises(ValueError, match="allowed"):
        to_param(torch.ones(1), "fp16", "sideways")
