"""Fixtures for the static-shape path: a tiny random Llama and its exported graphs (float and int8-static)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

S = 24  # static max length of the tiny graphs: a 23-token window


def make_llama(seed: int = 0, layers: int = 2, init: float = 0.1) -> Any:
    """A random Llama with GQA (4 query heads, 2 KV heads, head_dim 64) over the tiny tokenizer's 256 ids.  A
    larger init than the default spreads the logits, so greedy choices are not near ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                      initializer_range=init, attn_implementation="eager", eos_token_id=1, pad_token_id=1,
                      bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.requires_grad_(False)
    return model


@pytest.fixture(scope="session")
def llama_factory() -> Any:
    return make_llama


@pytest.fixture(scope="session")
def static_llama() -> Any:
    return make_llama()


@pytest.fixture(scope="session")
def int8_quant(static_llama: Any):
    from kvsqueeze.engines.static_calibration import calibrate_static

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 256, (400,), generator=g).tolist()
    return calibrate_static(static_llama, ids, bits=8, chunk_len=128)


@pytest.fixture(scope="session")
def float_graphs(static_llama: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvsqueeze.engines.onnx_export import export_static_graphs

    return export_static_graphs(static_llama, tmp_path_factory.mktemp("onnx") / "float", S)


@pytest.fixture(scope="session")
def int8_graphs(static_llama: Any, int8_quant, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvsqueeze.engines.onnx_export import export_static_graphs

    return export_static_graphs(static_llama, tmp_path_factory.mktemp("onnx") / "int8", S, quant=int8_quant)
