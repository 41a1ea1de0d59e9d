"""vLLM's fp8 KV cache: the conversion reference, scale calibration, the vllm-fp8 method and export --vllm."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kvsqueeze.calibrate import CalibrationSettings, calibrate
from kvsqueeze.calibrate.collect import CalibrationData
from kvsqueeze.calibrate.export_vllm import KV_SCHEME, export_vllm, reload_plain
from kvsqueeze.calibrate.vllm_fp8 import SCALE_GRID, calibrate_side, key_pair_angles, vllm_fp8_dequant
from kvsqueeze.transforms.matrices import rope_commuting

TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _representable(fmt: str) -> torch.Tensor:
    """Every finite value of the format, sorted (an independent table: torch's float8 decoding)."""
    v = torch.arange(256, dtype=torch.uint8).view(TORCH_FP8[fmt]).float()
    return torch.unique(v[torch.isfinite(v)])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_truncation_matches_the_table(fmt):
    table = _representable(fmt)
    assert torch.equal(vllm_fp8_dequant(table, fmt, 1.0), table)  # representable values stay
    g = torch.Generator().manual_seed(0)
    top = float(table.max())
    x = torch.cat([torch.randn(4000, generator=g) * 10 ** torch.empty(4000).uniform_(-6, 3, generator=g),
                   torch.tensor([top * 1.5, -top * 3])])
    got = vllm_fp8_dequant(x, fmt, 1.0)
    mag = x.abs().clamp(max=top)
    idx = torch.searchsorted(table, mag, right=True) - 1  # the largest representable magnitude <= |x|
    want = table[idx.clamp(min=0)] * torch.sign(x)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_nearest_rounding_is_torch_cast(fmt):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 3
    assert torch.equal(vllm_fp8_dequant(x, fmt, 0.5, "nearest"), (x / 0.5).to(TORCH_FP8[fmt]).float() * 0.5)


def test_scales_apply_before_and_after():
    x = torch.tensor([0.3, -1.7, 900.0])
    got = vllm_fp8_dequant(x, "e4m3", 2.0)
    assert torch.equal(got, vllm_fp8_dequant(x / 2.0, "e4m3", 1.0) * 2.0)
    assert got[2].item() == 448.0 * 2.0  # saturates at the format's maximum times the scale


def test_side_calibration_against_brute_force():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 40, 64, generator=g) * torch.linspace(0.01, 4, 64)
    cal = calibrate_side(x, "e4m3")
    naive = float(x.abs().max()) / 448.0
    assert cal.naive_scale == pytest.approx(naive)
    errs = []
    for m in SCALE_GRID:  # reference: per-head least squares written out for each head and scale
        q = vllm_fp8_dequant(x, "e4m3", naive * m)
        total = 0.0
        for h in range(3):
            c = float((x[:, h] * q[:, h]).sum() / (q[:, h] ** 2).sum())
            total += float(((x[:, h] - c * q[:, h]) ** 2).sum())
        errs.append(total / float((x ** 2).sum()))
    best = min(range(len(errs)), key=errs.__getitem__)
    assert cal.scale == pytest.approx(naive * SCALE_GRID[best])
    assert cal.mse == pytest.approx(errs[best], rel=1e-4)
    # truncation shrinks every element, so the compensation is > 1: about 1 / (1 - mean relative shrink)
    q = vllm_fp8_dequant(x, "e4m3", cal.scale)
    shrink = float(((x - q).abs() / x.abs().clamp_min(1e-30)).mean())
    assert all(1.0 < float(c) < 1.0 / (1.0 - 2 * shrink) for c in cal.compensation)


def _tiny_dir(tmp_path, tiny_llama, tiny_tokenizer):
    src = tmp_path / "tiny"
    tiny_llama.save_pretrained(src)
    tiny_tokenizer.save_pretrained(src)
    return src


def _artifact(tmp_path, tiny_llama, fmt="e4m3", **kw):
    ids = torch.randint(2, 256, (2, 64), generator=torch.Generator().manual_seed(3))
    data = CalibrationData(ids, {"source": "test", "samples": 2, "length": 64})
    art = calibrate(tiny_llama, data, CalibrationSettings(method="vllm-fp8", fp8_format=fmt, **kw), "tiny",
                    progress=False)
    return art.save(tmp_path / "art")


def test_pair_angles_minimise_the_weighted_products():
    g = torch.Generator().manual_seed(4)
    n, hq, hkv, length, d = 1, 2, 1, 24, 8
    q = torch.randn(n, hq, length, d, generator=g)
    k = torch.randn(n, hkv, length, d, generator=g)
    k[..., 1] *= 6  # a massive channel: its pair should be turned to share it
    phi = key_pair_angles(q, k, 0.35, steps=16)
    causal = torch.ones(length, length, dtype=torch.bool).tril()

    def cost(angles):  # reference: rotate explicitly and sum a_qk * sum_c (q_c k_c)^2 per pair
        a = rope_commuting(torch.zeros(hkv, d // 2), angles)
        qr, kr = q @ a[0], k @ a[0]
        att = (q @ k.transpose(-1, -2) * 0.35).masked_fill(~causal, float("-inf")).softmax(-1)
        prod = (qr[:, :, :, None, :] * kr[:, :, None, :, :]) ** 2  # [n, hq, Lq, Lk, d]
        per_c = (att[..., None] * prod).sum(dim=(0, 1, 2, 3))
        return per_c[: d // 2] + per_c[d // 2:]

    best = cost(phi[0][None])[0]
    grid = torch.arange(16) * (torch.pi / 2 / 16)
    for g_angle in grid:
        other = cost(torch.full((1, d // 2), float(g_angle)))[0]
        assert torch.all(best <= other * (1 + 1e-4))
    assert phi[0, 1] > 0.3  # the massive channel's pair is turned well away from it


def test_vllm_fp8_artifact(tmp_path, tiny_llama):
    from kvsqueeze import resolve_kv
    from kvsqueeze.calibrate import load_artifact

    path = _artifact(tmp_path, tiny_llama)
    art = load_artifact(path)
    assert art.transforms("key")[0][2] == "rope-commuting" and art.transforms("value")[0] is None
    assert art.method == "vllm-fp8" and art.window == 0 and art.sinks == 0
    for lay in art.layers:
        for side in ("key", "value"):
            assert lay[side].quant.fmt == "fp8-e4m3" and lay[side].tensors["vllm_scale"].dim() == 0
            assert lay[side].tensors["compensation"].shape == (2,)
    assert resolve_kv(str(path)).key.fp8_scale == "tensor"


def test_export_vllm_checkpoint(tmp_path, tiny_llama, tiny_tokenizer):
    src = _tiny_dir(tmp_path, tiny_llama, tiny_tokenizer)
    art_path = _artifact(tmp_path, tiny_llama, rotate_keys=False)
    out = tmp_path / "vllm"
    rec = export_vllm(art_path, out, str(src), progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    assert cfg["quantization_config"]["kv_cache_scheme"] == KV_SCHEME
    tensors = load_file(str(out / "model.safetensors"))
    from kvsqueeze.calibrate import load_artifact

    art = load_artifact(art_path)
    for i in range(2):
        for side, name in (("key", "k_scale"), ("value", "v_scale")):
            t = tensors[f"model.layers.{i}.self_attn.{name}"]
            assert t.dim() == 0 and t.dtype == torch.float32  # vLLM reads per-tensor scales with .tolist()
            assert t.item() == art.layers[i][side].tensors["vllm_scale"].item()
    # the folded weights: W_q rows of KV head h times c_k[h], o_proj input columns times c_v[h]
    ck = art.layers[0]["key"].tensors["compensation"]
    wq = tiny_llama.model.layers[0].self_attn.q_proj.weight
    assert torch.allclose(tensors["model.layers.0.self_attn.q_proj.weight"],
                          wq * ck.repeat_interleave(wq.shape[0] // 2)[:, None], rtol=1e-6, atol=1e-7)
    assert rec["logits_error"]["relative_l2"] <= 1e-4  # transformers reload == the folded model
    assert 0 < rec["unquantized_change"]["relative_l2"] < 0.2  # compensations are small but real
    reloaded = reload_plain(out, torch.float32)
    assert torch.equal(reloaded.model.layers[1].self_attn.o_proj.weight,
                       tensors["model.layers.1.self_attn.o_proj.weight"])


# A child process with compressed-tensors made unimportable (what scripts/setup.sh installs lacks it): transformers
# then treats the package as absent, as on a fresh set-up, whatever this environment holds.
_WITHOUT_COMPRESSED_TENSORS = """
import sys
sys.modules["compressed_tensors"] = None
from kvsqueeze.models import load_model
try:
    model, tok = load_model(sys.argv[1], progress=False)
except ValueError as e:
    print("ValueError:", e)
else:
    print("loaded", type(model).__name__, sum(p.numel() for p in model.parameters()))
"""


def _load_without_compressed_tensors(path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _WITHOUT_COMPRESSED_TENSORS, str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_exported_checkpoint_loads_without_compressed_tensors(tmp_path, tiny_llama, tiny_tokenizer):
    """``ppl --model EXPORTED --kv vllm:...`` loads the checkpoint in kvsqueeze's process (for its tokenizer and
    chunks): the KV-scales-only quantization entry must not ask for compressed-tensors there."""
    src = _tiny_dir(tmp_path, tiny_llama, tiny_tokenizer)
    out = tmp_path / "vllm"
    export_vllm(_artifact(tmp_path, tiny_llama, rotate_keys=False), out, str(src), progress=False)
    n = sum(p.numel() for p in tiny_llama.parameters())
    assert _load_without_compressed_tensors(out) == f"loaded {type(tiny_llama).__name__} {n}"
    # a checkpoint that does quantize weights with compressed-tensors: one line naming the package, no traceback
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["config_groups"] = {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False}}}
    (out / "config.json").write_text(json.dumps(cfg))
    line = _load_without_compressed_tensors(out)
    assert line.startswith("ValueError: Could not load") and "compressed-tensors" in line, line


def test_export_vllm_folds_key_rotations_exactly(tmp_path, tiny_llama, tiny_tokenizer):
    src = _tiny_dir(tmp_path, tiny_llama, tiny_tokenizer)
    art_path = _artifact(tmp_path, tiny_llama, compensate=False)  # rotations only: the function is unchanged
    rec = export_vllm(art_path, tmp_path / "vllm", str(src), progress=False)
    assert rec["logits_error"]["relative_l2"] <= 1e-4
    assert rec["unquantized_change"]["relative_l2"] <= 1e-4


def test_export_vllm_refuses_what_vllm_cannot_store(tmp_path, tiny_llama, tiny_tokenizer):
    src = _tiny_dir(tmp_path, tiny_llama, tiny_tokenizer)
    ids = torch.randint(2, 256, (2, 64), generator=torch.Generator().manual_seed(3))
    data = CalibrationData(ids, {"source": "test", "samples": 2, "length": 64})
    art = calibrate(tiny_llama, data, CalibrationSettings(method="kvquant", key_bits=2, value_bits=2), "tiny",
                    progress=False)
    path = art.save(tmp_path / "art")
    out = tmp_path / "vllm"
    with pytest.raises(ValueError, match="vLLM cannot represent .* 2-bit integer codes, per-channel"):
        export_vllm(path, out, str(src), progress=False)
    assert not out.exists() and not any(p.name.startswith(".vllm") for p in tmp_path.iterdir())
