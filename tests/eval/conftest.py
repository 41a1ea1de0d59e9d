"""Fixtures for the evaluation harness: a tiny random Llama saved with a byte-level tokenizer (so every command
can load it by path, offline, in well under a second) and small corpora."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

FILLER = ("The quick brown fox jumps over the lazy dog near the river bank. "
          "Seven small boats drift along the quiet canal at dawn. ")


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: any text, one token per byte, ids 0-255, EOS 256."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A saved random 2-layer Llama (2 query heads, 1 KV head, head_dim 64, vocab 257) and its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=257, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
                         eos_token_id=256, pad_token_id=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """About 6 kB of English: 6,000 byte tokens (90% of them may be evaluated)."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(FILLER * 50, encoding="utf-8")
    return path
