"""The absmax / percentile pass that fixes the static K/V parameters."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsqueeze.engines.static_calibration import BUILTIN_TEXT, calibrate_static, calibration_text, collect_kv

IDS = torch.randint(2, 256, (300,), generator=torch.Generator().manual_seed(5)).tolist()


def test_absmax_covers_every_calibration_value(static_llama):
    q = calibrate_static(static_llama, IDS, bits=8, chunk_len=100)
    assert q.k_scale.shape == (2, 2, 64) and q.storage_dtype == np.uint8 and q.meta["tokens"] == 300
    ks, vs = collect_kv(static_llama, IDS, chunk_len=100)
    for layer in range(2):
        for kind, x in (("k", ks[layer]), ("v", vs[layer])):
            x = x[:, None]  # [N, 1, H, D]: the token layout with batch 1
            err = np.abs(q.dequantize(q.quantize(x, kind, layer), kind, layer) - x)
            assert (err <= q.params(kind, layer)[0] / 2 * (1 + 1e-5) + 1e-7).all()  # rounding only, no clipping


def test_percentile_clips_and_tensor_granularity(static_llama):
    full = calibrate_static(static_llama, IDS, chunk_len=100)
    clipped = calibrate_static(static_llama, IDS, chunk_len=100, method="percentile", percentile=99.0)
    assert (clipped.k_scale <= full.k_scale + 1e-9).all() and (clipped.k_scale < full.k_scale).any()
    per_tensor = calibrate_static(static_llama, IDS, chunk_len=100, granularity="tensor", bits=4, symmetric=True)
    assert per_tensor.k_scale.shape == (2, 1, 1) and (per_tensor.k_zero == 8).all()
    assert np.allclose(per_tensor.k_scale[:, 0, 0] * 7, np.abs(np.stack(collect_kv(static_llama, IDS, 100)[0]))
                       .max(axis=(1, 2, 3)), rtol=1e-5)


def test_bad_settings(static_llama):
    with pytest.raises(ValueError, match="method"):
        calibrate_static(static_llama, IDS, method="mse")
    with pytest.raises(ValueError, match="granularity"):
        calibrate_static(static_llama, IDS, granularity="group")
    with pytest.raises(ValueError, match="percentile"):
        calibrate_static(static_llama, IDS, method="percentile", percentile=40)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        calibrate_static(static_llama, [5])


def test_calibration_text_sources(tmp_path, monkeypatch):
    monkeypatch.delenv("KVSQUEEZE_DATA", raising=False)
    assert calibration_text() == (BUILTIN_TEXT, "built-in paragraph")
    wiki = tmp_path / "wikitext-2-raw" / "wiki.test.raw"
    wiki.parent.mkdir()
    wiki.write_text("a" * 90 + "b" * 10)
    monkeypatch.setenv("KVSQUEEZE_DATA", str(tmp_path))
    text, where = calibration_text()
    assert text == "b" * 10 and "last 10%" in where
    with pytest.raises(ValueError, match="not found"):
        calibration_text(tmp_path / "missing.txt")

