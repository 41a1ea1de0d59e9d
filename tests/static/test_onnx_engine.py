"""The static path end to end on a tiny random Llama: export, ONNX Runtime, the manager, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsqueeze.adapter import cache_kwargs
from kvsqueeze.engines.onnx_export import export_static_graphs, model_fingerprint
from kvsqueeze.engines.onnx_runner import OrtStaticEngine
from kvsqueeze.engines.static_generation import first_divergence, greedy_generate, left_pad
from kvsqueeze.engines.static_manager import StaticKVManager, expected_copies
from kvsqueeze.engines.static_step import StaticStep
from kvsqueeze.engines.torch_static import TorchStaticEngine

pytest.importorskip("onnxruntime")
S, W = 24, 23  # the tiny graphs' static length (conftest.S) and window
PROMPT = [5, 9, 13, 200, 17]


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=1)
    return out[0, len(prompt):].tolist()


def test_step_module_matches_hf_logits(static_llama):
    """The hand-written static step (PyTorch) reproduces the model's own logits, prefill and decode, batch 2."""
    prompts = [[7, 8, 9, 10, 11, 12], [40, 41, 42]]
    full = [p + [100, 101, 102] for p in prompts]
    pre, dec = StaticStep(static_llama, 24, "prefill"), StaticStep(static_llama, 24, "decode")
    m = StaticKVManager(2, 2, 64, 24, batch_size=2)
    ids, mask, pos = left_pad(prompts, W)
    with torch.no_grad():
        out = pre(*(torch.from_numpy(a) for a in (ids, mask, pos)))
        m.load_prefill([o.numpy() for o in out[1::2]], [o.numpy() for o in out[2::2]], mask.sum(1))
        for r, p in enumerate(full):
            ref = static_llama(torch.tensor([p])).logits[0]
            torch.testing.assert_close(out[0][r], ref[len(prompts[r]) - 1], atol=1e-4, rtol=1e-4)
        for j in range(3):
            tok = torch.tensor([[p[len(q) + j]] for p, q in zip(full, prompts)])
            past = [torch.from_numpy(a) for layer in range(2) for a in m.window(layer)]
            o = dec(tok, torch.from_numpy(m.attention_mask()), torch.from_numpy(m.position_ids()), *past)
            m.append([x.numpy() for x in o[1::2]], [x.numpy() for x in o[2::2]])
            for r, p in enumerate(full):
                ref = static_llama(torch.tensor([p])).logits[0, len(prompts[r]) + j]
                torch.testing.assert_close(o[0][r], ref, atol=1e-4, rtol=1e-4)


def test_onnx_runs_and_matches_pytorch_logits(static_llama, float_graphs):
    eng = OrtStaticEngine(float_graphs, fingerprint=model_fingerprint(static_llama))
    res = greedy_generate(eng, eng.make_manager(), [PROMPT], 12, keep_logits=True)
    seq = PROMPT + res.tokens[0]
    with torch.no_grad():
        ref = static_llama(torch.tensor([seq])).logits[0].numpy()
    for i, logits in enumerate(res.logits):
        np.testing.assert_allclose(logits[0], ref[len(PROMPT) - 1 + i], atol=1e-4, rtol=1e-4)


def test_float_static_path_equals_transformers_generate(static_llama, float_graphs):
    eng = OrtStaticEngine(float_graphs)
    for prompt in (PROMPT, [3], list(range(30, 50))):
        n = S - len(prompt)  # up to the full static length
        res = greedy_generate(eng, eng.make_manager(1.5), [prompt], n)
        assert res.tokens[0] == _hf_greedy(static_llama, prompt, n)
        assert res.stats["requantizations"] == 0 and res.stats["staging_bytes"] == 0


def test_batch_of_two_prompts_of_different_lengths(static_llama, tmp_path):
    eng = OrtStaticEngine(export_static_graphs(static_llama, tmp_path / "b2", S, batch_size=2))
    prompts = [[11, 12, 13, 14, 15, 16, 17], [90, 91]]
    res = greedy_generate(eng, eng.make_manager(), prompts, 10)
    for r, p in enumerate(prompts):
        assert res.tokens[r] == _hf_greedy(static_llama, p, 10)


def test_sliding_past_S_copies_and_matches_pytorch(static_llama, float_graphs):
    """Beyond S the window slides (documented): ORT and the eager modules agree; copies follow the formula."""
    eng, te = OrtStaticEngine(float_graphs), TorchStaticEngine(static_llama, S)
    for reserve in (2.0, 1.5):
        a = greedy_generate(eng, eng.make_manager(reserve, on_full="slide"), [PROMPT], 70)
        b = greedy_generate(te, te.make_manager(reserve, on_full="slide"), [PROMPT], 70)
        assert a.tokens == b.tokens
        reserved = int(np.ceil(reserve * W))
        assert a.stats["copies"] == expected_copies(a.decode_steps, S, reserved)
        assert a.stats["copies"] <= a.decode_steps // W or reserve < 2


def test_stop_at_S_with_a_message(float_graphs):
    eng = OrtStaticEngine(float_graphs)
    res = greedy_generate(eng, eng.make_manager(on_full="stop"), [PROMPT], 100)
    assert len(res.tokens[0]) == S - len(PROMPT)
    assert "on_full='slide'" in res.stopped


def test_int8_codes_pass_from_output_to_input_bit_exact(int8_graphs):
    """What the decode graph writes is exactly what the next steps read, through copies too: no requantization."""
    eng = OrtStaticEngine(int8_graphs)
    m = eng.make_manager(1.5, on_full="slide")
    written: list[np.ndarray] = []
    commit = m.commit

    def spy(n: int = 1) -> None:
        written.append(m.slot(0, n)[0].copy())  # layer 0 K codes as ORT wrote them
        commit(n)

    m.commit = spy
    res = greedy_generate(eng, m, [PROMPT], 40)
    # 5-token prompt, 40 tokens: 39 decode steps; reserve 1.5 leaves ceil(1.5 * 23) - 23 = 12 free slots
    assert res.decode_steps == 39 and m.reserved == 35
    assert res.stats["copies"] == (39 - 1) // 12 == 3
    assert res.stats["bytes_moved"] == 3 * 2 * 2 * W * m.token_bytes and m.token_bytes == 2 * 64  # uint8 codes
    assert m.k[0].dtype == np.uint8 and res.stats["requantizations"] == 0
    window = m.window(0)[0]
    assert np.array_equal(window[-len(written[-W:]):], np.concatenate(written[-W:]))


def test_int8_static_matches_torch_engine_and_reports_divergence(static_llama, int8_quant, int8_graphs,
                                                                 float_graphs):
    eq = OrtStaticEngine(int8_graphs)
    te = TorchStaticEngine(static_llama, S, quant=int8_quant)
    n = S - len(PROMPT)
    a = greedy_generate(eq, eq.make_manager(), [PROMPT], n, keep_logits=True)
    b = greedy_generate(te, te.make_manager(), [PROMPT], n, keep_logits=True)
    assert a.tokens == b.tokens
    ef = OrtStaticEngine(float_graphs)
    f = greedy_generate(ef, ef.make_manager(), [PROMPT], n, keep_logits=True)
    div = first_divergence(f.tokens[0], a.tokens[0], f.logits, a.logits)
    assert div is None or div["tie_within_error"], div


def test_int4_graphs_export_and_match_the_torch_engine(static_llama, tmp_path):
    """4-bit codes (two per byte, unpacked in the graph without a bitwise AND, so opset 17 exports it): ONNX Runtime
    and the eager modules write the same packed codes and choose the same tokens, through window copies."""
    from kvsqueeze.engines.static_calibration import calibrate_static

    ids = torch.randint(2, 256, (400,), generator=torch.Generator().manual_seed(1)).tolist()
    for layout, quant in (("token", calibrate_static(static_llama, ids, bits=4, chunk_len=128)),
                          ("head", calibrate_static(static_llama, ids, bits=4, symmetric=True, granularity="tensor",
                                                    chunk_len=128))):
        eng = OrtStaticEngine(export_static_graphs(static_llama, tmp_path / layout, S, quant=quant, layout=layout))
        te = TorchStaticEngine(static_llama, S, quant=quant, layout=layout)
        ma, mb = eng.make_manager(1.5, on_full="slide"), te.make_manager(1.5, on_full="slide")
        a = greedy_generate(eng, ma, [PROMPT], 40, keep_logits=True)
        b = greedy_generate(te, mb, [PROMPT], 40, keep_logits=True)
        assert ma.k[0].dtype == np.uint8 and eng.info.stored_dim == 32
        assert a.tokens == b.tokens and a.stats["copies"] == 3
        np.testing.assert_allclose(np.concatenate(a.logits), np.concatenate(b.logits), atol=1e-3, rtol=1e-3)
        for layer in range(2):  # packed bytes: each nibble within one code of the other engine's (float noise)
            for x, y in zip(ma.window(layer), mb.window(layer)):
                x, y = x.astype(np.int16), y.astype(np.int16)
                assert (abs((x & 15) - (y & 15)) <= 1).all() and (abs((x >> 4) - (y >> 4)) <= 1).all()


def test_int8_static_vs_kvsqueeze_int8_cache(llama_factory, int8_quant, int8_graphs):
    """Same tokens as kvsqueeze's own (dynamic, per-token) int8 cache, or a first divergence at a near tie."""
    hf_adapter = pytest.importorskip("kvsqueeze.adapter")
    model = llama_factory()  # a fresh copy: the kvsqueeze cache switches the model's attention function
    eq = OrtStaticEngine(int8_graphs, fingerprint=model_fingerprint(model))
    for prompt in (PROMPT, [200, 3, 77, 45, 12, 9, 100]):
        n = S - len(prompt)
        a = greedy_generate(eq, eq.make_manager(), [prompt], n, keep_logits=True)
        cache = hf_adapter.QuantizedCache(model.config, "int8")
        out = model.generate(torch.tensor([prompt]), **cache_kwargs(model, cache), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=1, return_dict_in_generate=True, output_logits=True)
        ref = out.sequences[0, len(prompt):].tolist()
        div = first_divergence(ref, a.tokens[0], [x.numpy() for x in out.logits], a.logits)
        assert div is None or div["tie_within_error"], div


def test_head_layout_counts_its_staging_copies(static_llama, tmp_path, float_graphs):
    eng = OrtStaticEngine(export_static_graphs(static_llama, tmp_path / "head", S, layout="head"))
    res = greedy_generate(eng, eng.make_manager(), [PROMPT], 8)
    tok = greedy_generate(OrtStaticEngine(float_graphs), StaticKVManager(2, 2, 64, S), [PROMPT], 8)
    assert res.tokens == tok.tokens
    m = eng.make_manager()
    per_token = m.token_bytes * 2 * 2  # K and V of 2 layers
    # prefill output window + per decode step: the input window and the output token
    assert res.stats["staging_bytes"] == per_token * (W + res.decode_steps * (W + 1))


# ------------------------------------------------------------------------------------------- bad input
def test_prompt_longer_than_window(float_graphs):
    eng = OrtStaticEngine(float_graphs)
    m = eng.make_manager()
    with pytest.raises(ValueError, match="S-1 = 23"):
        greedy_generate(eng, m, [list(range(2, 26))], 4)
    assert m.stats.tokens_appended == 0


def test_batch_and_shape_mismatch(float_graphs):
    eng = OrtStaticEngine(float_graphs)
    with pytest.raises(ValueError, match="batch 1"):
        greedy_generate(eng, eng.make_manager(), [PROMPT, PROMPT], 4)
    with pytest.raises(ValueError, match="does not match the exported graph"):
        greedy_generate(eng, StaticKVManager(2, 2, 64, 32), [PROMPT], 4)
    with pytest.raises(ValueError, match="does not match the exported graph"):
        greedy_generate(eng, StaticKVManager(2, 2, 64, S, dtype=np.uint8), [PROMPT], 4)
    with pytest.raises(ValueError, match="input_ids must have shape"):
        eng.decode(eng.make_manager(), np.zeros((1, 2), np.int64))


def test_graphs_of_another_model_are_refused(llama_factory, float_graphs, tmp_path):
    other = llama_factory(seed=7)
    with pytest.raises(ValueError, match="another model"):
        OrtStaticEngine(float_graphs, fingerprint=model_fingerprint(other))
    (tmp_path / "prefill.onnx").write_bytes(b"not onnx")
    (tmp_path / "decode.onnx").write_bytes(b"not onnx")
    with pytest.raises(ValueError, match="not a loadable ONNX graph"):
        OrtStaticEngine(tmp_path)
    with pytest.raises(ValueError, match="no exported static graphs"):
        OrtStaticEngine(tmp_path / "missing")
