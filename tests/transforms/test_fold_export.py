"""Folding transforms into the weights, the transformed codec, the invertible method, artifacts and export."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from _families import random_value_transform
from kvsqueeze.adapter import QuantizedCache, cache_kwargs
from kvsqueeze.artifact import SPEC_FILE, seal_document
from kvsqueeze.cache.codecs_transform import TransformedCodec
from kvsqueeze.cache.factory import make_codec
from kvsqueeze.calibrate import CalibrationSettings, calibrate, load_artifact
from kvsqueeze.calibrate.collect import CalibrationData, rope_tables
from kvsqueeze.calibrate.fold import fold_transforms
from kvsqueeze.calibrate.invertible import fake_quant_ste, grouping_quants
from kvsqueeze.quant.extras import TransformExtras
from kvsqueeze.spec import QuantSpec
from kvsqueeze.transforms.matrices import GeneralTransform, hadamard, rope_commuting, rope_commuting_inverse

D = 64


def _ids(n: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 256, (n, length), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids, cache=None):
    with torch.no_grad():
        return model(ids, **cache_kwargs(model, cache), use_cache=cache is not None).logits


def _random_transforms(model, seed: int = 0, online_keys: bool = False):
    """Per layer (A, A^-1, family) for keys and values of every attention layer of ``model``."""
    n = model.config.num_hidden_layers
    hkv = model.config.num_key_value_heads
    g = torch.Generator().manual_seed(seed)
    keys, values = [], []
    for _ in range(n):
        if online_keys:
            t = GeneralTransform(hkv, D, rank=4, base="hadamard", seed=seed)
            with torch.no_grad():
                t.u.normal_(0, 0.2, generator=g)
            keys.append((t.matrix().detach(), t.inverse().detach(), "general"))
        else:
            u, phi = torch.randn(hkv, D // 2, generator=g) * 0.5, torch.rand(hkv, D // 2, generator=g) * 6
            keys.append((rope_commuting(u, phi), rope_commuting_inverse(u, phi), "rope-commuting"))
        values.append(random_value_transform(hkv, D, seed, g))
    return keys, values


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_mixed_sliding"])
def test_folding_keeps_full_precision_logits(fixture, request):
    model = request.getfixturevalue(fixture)  # Llama GQA; Qwen2 with q/k/v biases and sliding layers
    folded = copy.deepcopy(model)
    keys, values = _random_transforms(model)
    fold_transforms(folded, keys, values, rope_tables(model)[0])
    ids = _ids(1, 48)
    ref, out = _logits(model, ids), _logits(folded, ids)
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-4
    # and the folded model's cached keys/values really are the transformed ones
    attn, fattn = model.model.layers[0].self_attn, folded.model.layers[0].self_attn
    x = torch.randn(1, 5, model.config.hidden_size)
    h = model.config.num_key_value_heads
    v_old = attn.v_proj(x).view(1, 5, h, D).transpose(1, 2)
    v_new = fattn.v_proj(x).view(1, 5, h, D).transpose(1, 2)
    assert torch.allclose(v_new, v_old @ values[0][0][None], atol=1e-4)


def test_folding_refuses_key_transforms_that_do_not_commute_with_rope(tiny_llama):
    keys, values = _random_transforms(tiny_llama, online_keys=True)
    with pytest.raises(ValueError, match="does not commute with RoPE"):
        fold_transforms(copy.deepcopy(tiny_llama), keys, values, rope_tables(tiny_llama)[0])


def test_transformed_codec_round_trips_and_keeps_the_inner_layout():
    keys, _ = _random_transforms(type("M", (), {"config": type("C", (), {"num_hidden_layers": 1,
                                                                           "num_key_value_heads": 2})})())
    a, inv, fam = keys[0]
    inner = QuantSpec(fmt="int", bits=8, axis="token", group=32, param_dtype="fp32")
    spec = dataclasses.replace(inner, extras=TransformExtras(a, inv, fam))
    codec = make_codec(spec, D, torch.float32)
    assert isinstance(codec, TransformedCodec)
    assert codec.layout() == make_codec(inner, D, torch.float32).layout()
    x = torch.randn(1, 2, 9, D)
    err = (codec.decode(codec.encode(x)) - x).abs().max()
    assert err < 0.05 * x.abs().max()
    spec.extras.check(2, D)
    squashed = a * torch.tensor([1.0, 1e-6]).repeat(32)[None, None]
    with pytest.raises(ValueError, match="ill-conditioned: condition number 1"):
        TransformExtras(squashed, torch.linalg.inv(squashed.double()).float()).check(2, D)


def test_folded_model_with_plain_cache_equals_original_with_transformed_cache(tiny_llama):
    keys, values = _random_transforms(tiny_llama, seed=3)
    folded = copy.deepcopy(tiny_llama)
    fold_transforms(folded, keys, values, rope_tables(tiny_llama)[0])
    data = CalibrationData(_ids(2, 64), {"source": "random ids (test)"})
    art = calibrate(tiny_llama, data, CalibrationSettings(method="invertible", transform="learned-folded",
                                                          key_bits=8, value_bits=8, key_group=64, value_group=64,
                                                          param_dtype="fp32", steps=0, window=4, sinks=0),
                    "tiny", progress=False)
    # replace the (unlearned) transforms by the random ones folded above
    for lay, kt, vt in zip(art.layers, keys, values):
        lay["key"].tensors.update(transform=kt[0], transform_inv=kt[1])
        lay["value"].tensors.update(transform=vt[0], transform_inv=vt[1])
        lay["value"].settings["transform"] = {"name": "random", "family": "general"}
    ids = _ids(1, 40, seed=5)
    out_t = _logits(tiny_llama, ids, QuantizedCache(tiny_llama.config, art.cache_spec()))
    out_f = _logits(folded, ids, QuantizedCache(folded.config, art.with_transforms_folded().cache_spec()))
    ref = _logits(tiny_llama, ids)
    assert ((out_t - out_f).norm() / ref.norm()).item() < 2e-3  # equal but for rounding ties at 8 bits
    assert ((out_t - ref).norm() / ref.norm()).item() < 2e-2


@pytest.mark.parametrize("grouping", ["token", "kivi"])
def test_ste_quantizer_matches_the_cache_codec_forward_and_passes_gradients(grouping):
    kq, vq = grouping_quants(grouping, 4, 4, 32, 32, "fp32")
    x = torch.randn(2, 3, 64, D, requires_grad=True)
    fq = fake_quant_ste(x, kq)
    codec = make_codec(kq, D, torch.float32)
    ref = codec.decode(codec.encode(x.detach()))
    assert (fq - ref).abs().max() < 1e-3 * x.abs().max()  # same grid up to parameter rounding
    fq.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


@pytest.fixture(scope="module")
def learned(tiny_llama, tmp_path_factory):
    data = CalibrationData(_ids(2, 96), {"source": "random ids (test)"})
    s = CalibrationSettings(method="invertible", transform="learned-folded", key_bits=2, value_bits=2,
                            key_group=64, value_group=64, param_dtype="fp16", steps=30, window=8, sinks=1)
    art = calibrate(tiny_llama, data, s, "tiny", progress=False)
    return art, art.save(tmp_path_factory.mktemp("inv"))


def test_learning_reduces_the_objective_and_round_trips_through_an_artifact(tiny_llama, learned):
    art, path = learned
    for lay in art.layers:
        rec = lay["key"].settings["objective"]
        assert sum(rec["error_after"]) < sum(rec["error_init"])
        assert max(lay["value"].settings["transform"]["condition"]) < 100
    loaded = load_artifact(path)
    for a, b in zip(art.transforms("value"), loaded.transforms("value")):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    ids = _ids(1, 30, seed=9)
    c1, c2 = QuantizedCache(tiny_llama.config, art.cache_spec()), QuantizedCache(tiny_llama.config, str(path))
    assert torch.equal(_logits(tiny_llama, ids, c1), _logits(tiny_llama, ids, c2))


def test_ill_conditioned_or_inconsistent_transforms_are_refused_at_load(learned, tmp_path):
    from safetensors.torch import load_file, save_file

    art, path = learned
    for how, match in (("scale", "ill-conditioned: condition number"), ("inverse", "disagree")):
        bad = tmp_path / how
        import shutil

        shutil.copytree(path, bad)
        t = load_file(str(bad / "tensors.safetensors"))
        key = "layers.0.value.transform"
        if how == "scale":
            t[key] = t[key] * torch.logspace(0, 6, D)[None, None, :]
            t[key + "_inv"] = torch.linalg.inv(t[key].double()).float().contiguous()
        else:
            t[key + "_inv"] = t[key + "_inv"] * 1.01
        save_file(t, str(bad / "tensors.safetensors"))
        # re-sealed, as a hand-written artifact would be: the transform checks, not the checksum, must refuse it
        doc = json.loads((bad / SPEC_FILE).read_text())
        (bad / SPEC_FILE).write_text(json.dumps(seal_document(doc, bad / "tensors.safetensors")))
        with pytest.raises(ValueError, match=match):
            load_artifact(bad)


def test_export_writes_a_plain_checkpoint_that_matches(tiny_llama, tiny_tokenizer, learned, tmp_path):
    from transformers import AutoModelForCausalLM

    from kvsqueeze.calibrate.export import ARTIFACT_SUBDIR, EXPORT_FILE, export_folded

    art, path = learned
    src = tmp_path / "tiny-src"
    tiny_llama.save_pretrained(src)
    tiny_tokenizer.save_pretrained(src)
    out = tmp_path / "folded"
    rec = export_folded(path, out, str(src), progress=False)
    assert rec["logits_error"]["relative_l2"] <= 1e-4
    assert json.loads((out / EXPORT_FILE).read_text())["artifact"] == art.name
    plain = AutoModelForCausalLM.from_pretrained(out)
    ids = _ids(1, 33, seed=2)
    ref = _logits(tiny_llama, ids)
    assert ((_logits(plain, ids) - ref).norm() / ref.norm()).item() <= 1e-4
    # the folded model with the transform-free artifact equals the original with the transformed cache
    c_f = QuantizedCache(plain.config, str(out / ARTIFACT_SUBDIR))
    c_t = QuantizedCache(tiny_llama.config, str(path))
    assert ((_logits(plain, ids, c_f) - _logits(tiny_llama, ids, c_t)).norm() / ref.norm()).item() < 5e-3
    with pytest.raises(ValueError, match="--overwrite"):
        export_folded(path, out, str(src), progress=False)
    export_folded(path, out, str(src), overwrite=True, progress=False)


def test_export_refuses_online_key_transforms(tiny_llama, tmp_path):
    from kvsqueeze.calibrate.export import export_folded

    data = CalibrationData(_ids(1, 64), {"source": "random ids (test)"})
    s = CalibrationSettings(method="invertible", transform="hadamard", key_bits=4, value_bits=4, key_group=64,
                            value_group=64, param_dtype="fp16", window=8, sinks=1)
    path = calibrate(tiny_llama, data, s, "tiny", progress=False).save(tmp_path)
    with pytest.raises(ValueError, match="not RoPE-commuting"):
        export_folded(path, tmp_path / "out", None, progress=False)
    assert not (tmp_path / "out").exists()


def test_hadamard_baseline_is_exactly_the_hadamard(tiny_llama):
    data = CalibrationData(_ids(1, 64), {"source": "random ids (test)"})
    s = CalibrationSettings(method="invertible", transform="hadamard", key_bits=4, value_bits=4, key_group=64,
                            value_group=64, param_dtype="fp16", window=8, sinks=1)
    art = calibrate(tiny_llama, data, s, "tiny", progress=False)
    a, inv, fam = art.transforms("key")[0]
    assert fam == "general" and torch.allclose(a[0], hadamard(D)) and torch.allclose(inv[0], hadamard(D).T)


def test_export_cli_refuses_a_non_empty_directory_and_bad_artifacts(learned, tmp_path, capsys):
    from kvsqueeze.cli import main

    _, path = learned
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", "--kv", str(path), "--folded", str(out), "--quiet"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert main(["export", "--kv", str(tmp_path / "missing"), "--folded", str(tmp_path / "o2"), "--quiet"]) == 2
    assert "artifact" in capsys.readouterr().err


def test_learning_is_deterministic_for_a_seed_and_online_keys_are_general(tiny_llama):
    data = CalibrationData(_ids(1, 64, seed=4), {"source": "random ids (test)"})

    def run(seed: int):
        s = CalibrationSettings(method="invertible", transform="learned-online", key_bits=3, value_bits=3,
                                key_group=64, value_group=64, param_dtype="fp16", steps=5, seed=seed, window=8,
                                sinks=1)
        return calibrate(tiny_llama, data, s, "tiny", progress=False)

    a, b, c = run(0), run(0), run(1)
    ka, kb, kc = a.transforms("key")[0], b.transforms("key")[0], c.transforms("key")[0]
    assert torch.equal(ka[0], kb[0]) and torch.equal(a.transforms("value")[1][0], b.transforms("value")[1][0])
    assert not torch.equal(ka[0], kc[0])
    assert ka[2] == "general"


def test_bad_invertible_settings_name_the_allowed_values():
    with pytest.raises(ValueError, match="allowed: none, hadamard, smooth, learned-folded, learned-online"):
        CalibrationSettings(method="invertible", transform="rotate")
    with pytest.raises(ValueError, match="allowed: token, kivi, skvq"):
        CalibrationSettings(method="invertible", grouping="rows")
    with pytest.raises(ValueError, match="need --grouping skvq"):
        CalibrationSettings(method="invertible", value_bits=1.5, grouping="token")
