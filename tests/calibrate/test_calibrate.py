"""Calibrated methods: reordering/folding exactness, clip search, pre-RoPE keys, outliers, artifacts, CLI."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch

from kvsqueeze.adapter import QuantizedCache, cache_kwargs
from kvsqueeze.cache.codecs_calibrated import (
    PermutedGroupCodec,
    PreRopeKeyCodec,
    decode_outliers,
    encode_outliers,
    pack_ternary,
    ternary_nbytes,
    unpack_ternary,
)
from kvsqueeze.calibrate import CalibrationSettings, calibrate, fold_value_permutation, load_artifact
from kvsqueeze.calibrate.clip import attention_out, head_error, search_clip
from kvsqueeze.calibrate.collect import CalibrationData, corpus_samples, rope_tables
from kvsqueeze.eval.protocols import nll_all_quantized, nll_decode, nll_reference, nll_window
from kvsqueeze.quant.extras import GroupExtras, PreRopeExtras
from kvsqueeze.rope import apply_rope, rope_cos_sin, undo_rope
from kvsqueeze.spec import QuantSpec


def _ids(n: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 256, (n, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def skvq_artifact(tiny_llama, tmp_path_factory):
    data = CalibrationData(_ids(2, 64), {"source": "random ids (test)"})
    art = calibrate(tiny_llama, data, CalibrationSettings(method="skvq", window=16, sinks=2), "tiny", progress=False)
    return art, art.save(tmp_path_factory.mktemp("art"))


@pytest.fixture(scope="module")
def hybrid_artifact(tiny_llama, tmp_path_factory):
    data = CalibrationData(_ids(2, 64, seed=1), {"source": "random ids (test)"})
    settings = CalibrationSettings(method="hybrid", nuq=True, window=16, sinks=2, clip="group")
    art = calibrate(tiny_llama, data, settings, "tiny", progress=False)
    return art, art.save(tmp_path_factory.mktemp("art"))


def _logits(model, ids, cache=None):
    with torch.no_grad():
        return model(ids, **cache_kwargs(model, cache), use_cache=cache is not None).logits


# ------------------------------------------------------------------------------------------------ exactness
def test_fold_value_permutation_keeps_full_precision_logits(tiny_llama):
    folded = copy.deepcopy(tiny_llama)
    g = torch.Generator().manual_seed(0)
    perms = [torch.stack([torch.randperm(64, generator=g) for _ in range(2)]) for _ in range(2)]
    fold_value_permutation(folded, perms)
    ids = _ids(1, 40)
    ref, out = _logits(tiny_llama, ids), _logits(folded, ids)
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-4
    # the folded model's values are the permuted values: v_new[..., j] = v_old[..., perm[j]]
    x = torch.randn(1, 5, 256)
    v_old = tiny_llama.model.layers[0].self_attn.v_proj(x).view(1, 5, 2, 64)
    v_new = folded.model.layers[0].self_attn.v_proj(x).view(1, 5, 2, 64)
    assert torch.allclose(v_new, torch.stack([v_old[:, :, h, perms[0][h]] for h in range(2)], 2), atol=1e-6)


def test_reordering_is_exact_with_quantization_at_8_bits_and_folding_equals_gather(tiny_llama, skvq_artifact):
    art, path = skvq_artifact
    # the gather itself is exact: a permuted codec equals the plain codec on permuted channels, permuted back
    x = torch.randn(1, 2, 7, 64)
    perm = torch.stack([torch.randperm(64), torch.randperm(64)])
    spec = QuantSpec(fmt="int", bits=8, axis="token", group=32, param_dtype="fp32")
    permuted = PermutedGroupCodec(spec, 64, GroupExtras(perm))
    plain = PermutedGroupCodec(spec, 64)
    xp = x.gather(-1, perm.view(1, 2, 1, 64).expand_as(x))
    want = plain.decode(plain.encode(xp)).gather(-1, torch.argsort(perm).view(1, 2, 1, 64).expand_as(x))
    assert torch.equal(permuted.decode(permuted.encode(x)), want)
    # folding the value permutation into W_v/W_o gives the same quantized-cache logits as the codec's gather
    folded = copy.deepcopy(tiny_llama)
    fold_value_permutation(folded, [lay["value"].tensors.get("perm") for lay in art.layers])
    ids = _ids(1, 60, seed=3)
    a = _logits(tiny_llama, ids, QuantizedCache(tiny_llama.config, str(path)))
    b = _logits(folded, ids, QuantizedCache(folded.config, art.with_values_folded().cache_spec()))
    assert ((a - b).norm() / a.norm()).item() <= 1e-4


def test_pre_rope_path_equals_post_rope_path_without_quantization(tiny_llama):
    inv_freq, scaling = rope_tables(tiny_llama)
    # RoPE round trip at arbitrary positions
    x = torch.randn(1, 2, 9, 64)
    cos, sin = rope_cos_sin(torch.arange(100, 109), inv_freq, scaling)
    assert torch.allclose(undo_rope(apply_rope(x, cos, sin), cos, sin, scaling), x, atol=1e-5)
    ex = PreRopeExtras(torch.zeros(2, 64), torch.ones(2, 64), inv_freq, scaling, bits=None)
    spec = dataclasses.replace(QuantizedCache(tiny_llama.config, "full").spec, key=QuantSpec(extras=ex),
                               value=QuantSpec(fmt="none"), window=8, sinks=3, name="prerope-fp")
    ids = _ids(1, 50, seed=4)
    cache = QuantizedCache(tiny_llama.config, spec)
    ref = _logits(tiny_llama, ids)
    with torch.no_grad():  # prompt, then token-by-token decode so history is read back from the pre-RoPE store
        out = [tiny_llama(ids[:, :20], **cache_kwargs(tiny_llama, cache), use_cache=True).logits]
        for t in range(20, 50):
            out.append(tiny_llama(ids[:, t:t + 1], **cache_kwargs(tiny_llama, cache), use_cache=True).logits)
    assert cache.layers[0].kv.n_history > 0
    got = torch.cat(out, dim=1)
    assert ((got - ref).norm() / ref.norm()).item() <= 1e-4
    # the one-pass emulation un-rotates and re-rotates at the same absolute positions
    w = nll_window(tiny_llama, ids, spec, prefix=0)
    r = nll_reference(tiny_llama, ids, prefix=0)
    assert torch.allclose(w, r, rtol=1e-4, atol=1e-5)


def test_calibrated_window_protocol_equals_real_cache(tiny_llama, hybrid_artifact):
    _, path = hybrid_artifact
    spec = load_artifact(path).cache_spec()
    ids = _ids(1, 48, seed=5)
    w = nll_window(tiny_llama, ids, spec, prefix=20)
    d = nll_decode(tiny_llama, ids, QuantizedCache(tiny_llama.config, spec), prefix=20)
    assert torch.allclose(w, d, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------ parts
def test_clip_search_finds_known_optimum():
    # values on the 2-bit grid of the range [-0.5, 0.5], with one +-1 outlier pair per token: alpha = 0.5 makes
    # every inlier exact; the attention picks one token per query, so the output error is the token's error
    g = torch.Generator().manual_seed(0)
    levels = torch.tensor([-0.5, -1 / 6, 1 / 6, 0.5])
    t, d = 64, 64
    v = levels[torch.randint(0, 4, (1, 1, t, d), generator=g)]
    v[..., 0], v[..., 1] = 1.0, -1.0
    k = torch.eye(t, d).view(1, 1, t, d)
    q = 200.0 * k
    qpos = torch.arange(t)
    ref = attention_out(q, k, v, qpos, 1.0)
    spec = QuantSpec(fmt="int", bits=2, axis="token", group=None, param_dtype="fp32")

    def errors_of(clip):
        c = PermutedGroupCodec(spec, d, GroupExtras(None, clip))
        return head_error(ref, attention_out(q, k, c.decode(c.encode(v)), qpos, 1.0))

    grid = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4)
    assert search_clip(errors_of, 1, 1, "layer", grid).item() == pytest.approx(0.5)
    assert search_clip(errors_of, 1, 1, "none", grid).item() == 1.0


def test_outlier_side_structure_round_trips_exactly():
    x = torch.randn(2, 3, 5, 64).half().float()  # fp16-representable: outliers are stored in fp16
    recon = torch.zeros_like(x)
    x[..., 7] = 1000.0  # the worst channel must be picked
    parts = encode_outliers(x, recon, 2)
    assert parts["oidx"].dtype == torch.uint8 and parts["oval"].dtype == torch.float16
    assert (parts["oidx"] == 7).any(-1).all()
    out = decode_outliers(recon, parts["oidx"], parts["oval"])
    idx = parts["oidx"].long()
    assert torch.equal(out.gather(-1, idx), x.gather(-1, idx))
    mask = torch.zeros_like(x, dtype=torch.bool).scatter(-1, idx, True)
    assert torch.equal(out[~mask], recon[~mask])
    # through the codec: the outlier channels of the pre-RoPE key come back exactly
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    ex = PreRopeExtras(-torch.ones(3, 64), torch.ones(3, 64), inv_freq, 1.0, bits=2, outliers=1)
    codec = PreRopeKeyCodec(QuantSpec(extras=ex), 64, ex)
    cos, sin = rope_cos_sin(torch.arange(5), inv_freq, 1.0)
    pre = torch.randn(2, 3, 5, 64).half().float()
    parts = codec.encode(apply_rope(pre, cos, sin))
    dense = codec.dequantize_pre(torch.zeros(2, 3, 5, 64, dtype=torch.uint8))
    got = pre.gather(-1, parts["oidx"].long())
    assert torch.allclose(parts["oval"].float(), got, atol=1e-3)  # un-rotation costs float rounding only
    assert dense.shape == pre.shape


def test_ternary_packing_and_bits():
    c = torch.randint(0, 3, (2, 3, 4, 64), dtype=torch.uint8)
    p = pack_ternary(c)
    assert p.shape[-1] == ternary_nbytes(64) == 13
    assert torch.equal(unpack_ternary(p, 64), c)
    spec = QuantSpec(fmt="ternary", group=32, param_dtype="fp8-e4m3")
    codec = PermutedGroupCodec(spec, 64)
    nbytes = sum(lay.tail[0] * torch.empty(0, dtype=lay.dtype).element_size() for lay in codec.layout().values())
    assert 8 * nbytes / 64 == pytest.approx(1.625 + 0.5)  # codes 13 bytes, 2 groups x (scale, zero) fp8
    x = torch.randn(1, 2, 3, 64)
    xh = codec.decode(codec.encode(x))
    assert xh.shape == x.shape and torch.isfinite(xh).all()


# ------------------------------------------------------------------------------------------------ artifacts
def test_artifact_save_load_round_trip(tiny_llama, hybrid_artifact):
    art, path = hybrid_artifact
    loaded = load_artifact(path)
    assert loaded.name == path.name == art.name
    assert loaded.calibration == art.calibration and loaded.window == 16 and loaded.sinks == 2
    for a, b in zip(art.layers, loaded.layers):
        for side in ("key", "value"):
            assert a[side].kind == b[side].kind and a[side].quant == b[side].quant
            assert a[side].tensors.keys() == b[side].tensors.keys()
            for name in a[side].tensors:
                assert torch.equal(a[side].tensors[name], b[side].tensors[name])
    ids = _ids(1, 40, seed=6)
    a = _logits(tiny_llama, ids, QuantizedCache(tiny_llama.config, art.cache_spec()))
    b = _logits(tiny_llama, ids, QuantizedCache(tiny_llama.config, str(path)))
    assert torch.equal(a, b)
    doc = json.loads((path / "kvsqueeze_artifact.json").read_text())
    assert doc["method"] == "hybrid" and doc["layers"][0]["key"]["kind"] == "prerope"
    record = QuantizedCache(tiny_llama.config, str(path)).spec.to_dict()
    assert json.loads(json.dumps(record)) == record  # a JSON-clean spec record: it round-trips unchanged


def test_artifact_bad_input(tiny_llama, tiny_mixed_sliding, skvq_artifact, tmp_path, monkeypatch):
    art, path = skvq_artifact
    with pytest.raises(ValueError, match="was made for a model"):
        QuantizedCache(tiny_mixed_sliding.config, str(path))  # 4 layers
    other = copy.deepcopy(tiny_llama.config)
    other.num_key_value_heads = 4
    with pytest.raises(ValueError, match="was made for a model"):
        QuantizedCache(other, str(path))
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    (broken / "tensors.safetensors").unlink()
    with pytest.raises(ValueError, match="tensors.safetensors is missing"):
        load_artifact(broken)
    shutil.copytree(path, tmp_path / "corrupt")
    (tmp_path / "corrupt" / "kvsqueeze_artifact.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_artifact(tmp_path / "corrupt")
    shutil.copytree(path, tmp_path / "garbled")
    (tmp_path / "garbled" / "tensors.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(ValueError, match="does not match the checksum"):
        load_artifact(tmp_path / "garbled")
    with pytest.raises(ValueError, match="not a directory"):
        load_artifact(tmp_path / "nowhere")
    # a failed save leaves nothing behind
    import safetensors.torch

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        art.save(out)
    assert list(out.iterdir()) == []


def test_calibration_slice_is_disjoint_from_evaluation(tiny_tokenizer, tmp_path):
    from kvsqueeze.corpus import MAX_EVAL_FRACTION, eval_chunks, load_text_file, tokenize

    f = tmp_path / "c.txt"
    f.write_text(" ".join(f"w{2 + i % 250}" for i in range(3000)))
    corpus = load_text_file(f)
    data = corpus_samples(corpus, tiny_tokenizer, samples=100, length=64)
    n = tokenize(corpus, tiny_tokenizer).numel()
    assert data.provenance["token_start"] == int(n * MAX_EVAL_FRACTION)
    assert data.provenance["disjoint_from_evaluation"] and data.provenance["sha256"] == corpus.sha256
    assert data.ids.shape == (300 // 64, 64)  # clamped to what the tail holds
    with pytest.raises(ValueError, match="reserved for calibration"):
        eval_chunks(tokenize(corpus, tiny_tokenizer), 1000, 3)  # evaluation cannot reach the tail
    with pytest.raises(ValueError, match="overlaps the evaluation chunks"):
        corpus_samples(corpus, tiny_tokenizer, samples=2, length=64, start_fraction=0.5)
    assert not corpus_samples(corpus, tiny_tokenizer, 2, 64, 0.5, allow_overlap=True
                              ).provenance["disjoint_from_evaluation"]


def test_calibrate_command_on_tiny_model_runs_in_seconds(tiny_llama, tiny_tokenizer, tmp_path):
    from kvsqueeze.cli import main

    model_dir = tmp_path / "tiny"
    tiny_llama.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"w{2 + (i * 7) % 250}" for i in range(2000)))
    rc = main(["calibrate", "--method", "skvq", "--model", str(model_dir), "--text", str(text), "--samples", "2",
               "--length", "64", "--out", str(tmp_path / "arts"), "--quiet"])
    assert rc == 0
    (art_dir,) = list((tmp_path / "arts").iterdir())
    assert art_dir.name.startswith("tiny-skvq-k2g32-v1.5g32")
    art = load_artifact(art_dir)
    assert art.calibration["source"] == "corpus-tail" and len(art.calibration["sha256"]) == 64
    rc = main(["calibrate", "--method", "skvq", "--model", str(model_dir), "--text", str(text),
               "--start-fraction", "0.2", "--out", str(tmp_path / "arts2")])
    assert rc == 2 and not (tmp_path / "arts2").exists()


def test_ppl_harness_accepts_artifact_paths(tiny_llama, skvq_artifact):
    from kvsqueeze.eval.ppl import run_ppl
    from kvsqueeze.resolve import resolve_kv

    _, path = skvq_artifact
    assert resolve_kv(str(path)).layer_overrides is not None
    chunks = _ids(1, 64, seed=7)
    win = run_ppl(tiny_llama, chunks, str(path), "window")
    allq = run_ppl(tiny_llama, chunks, str(path), "all-quantized")
    spec = resolve_kv(str(path))
    # the reported perplexities are the protocols' own NLLs, through the artifact loaded from disk
    assert win["ppl"] == pytest.approx(math.exp(nll_window(tiny_llama, chunks, spec).mean().item()), rel=1e-9)
    assert allq["ppl"] == pytest.approx(math.exp(nll_all_quantized(tiny_llama, chunks, spec).mean().item()),
                                        rel=1e-9)
    assert 2.0 < win["quantized_bits_per_element"] < 2.5  # K2 g32 fp8 = 2.5, ternary V g32 fp8 = 2.125
    assert json.loads(json.dumps(win["spec"])) == win["spec"] and win["spec"]["calibrated_layers"] == 2


def test_objective_keeps_sinks_and_window_exact():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g) for _ in range(3))
    k_hat, v_hat = k + 1.0, v - 1.0
    qpos = torch.arange(10, 40)
    exact = attention_out(q, k, v, qpos, 0.3)
    assert exact.shape == (1, 2, 30, 8)  # one query head per KV head here
    assert torch.allclose(attention_out(q, k, v, qpos, 0.3, k_hat, v_hat, window=40, sinks=0), exact)
    assert torch.allclose(attention_out(q, k, v, qpos, 0.3, k_hat, v_hat, window=0, sinks=40), exact)
    assert not torch.allclose(attention_out(q, k, v, qpos, 0.3, k_hat, v_hat, window=4, sinks=2), exact)
