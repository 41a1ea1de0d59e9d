"""Perplexity corpora: a text file or WikiText-2, its SHA-256, tokenization and evaluation chunks.

Chunks are consecutive, non-overlapping windows of ``context`` tokens taken from the start of the corpus.  The
last 10% of every corpus is reserved for calibration (methods must never be calibrated on the text they are
evaluated on), so chunks that would reach into it are refused rather than silently used.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DATASETS = ("wikitext2",)
WIKITEXT2_RELATIVE = Path("wikitext-2-raw") / "wiki.test.raw"
MAX_EVAL_FRACTION = 0.9  # the tail beyond this fraction of the tokens is the calibration slice

WIKITEXT2_HOWTO = (
    "WikiText-2 was not found: set KVSQUEEZE_DATA to a folder containing wikitext-2-raw/wiki.test.raw "
    "(in this repository's checkout: KVSQUEEZE_DATA=../shared/data), pass --text FILE, or install the "
    "'datasets' package and run online to fetch wikitext-2-raw-v1 (test split) from the hub"
)


class CorpusUnavailable(ValueError):
    """The requested corpus cannot be found (a ValueError, so the CLI reports it in one line)."""


@dataclass(frozen=True)
class Corpus:
    text: str
    name: str  # "wikitext2" or the file name
    source: str  # where it was read from: a path or "hub:wikitext/wikitext-2-raw-v1/test"
    sha256: str  # of the UTF-8 bytes of ``text`` (for a file: the file itself, byte for byte)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "sha256": self.sha256, "chars": len(self.text)}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_text_file(path: str | Path, name: str | None = None) -> Corpus:
    p = Path(path).expanduser()
    if not p.is_file():
        raise CorpusUnavailable(f"corpus file not found: {p}")
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")  # bytes decoded as-is: CRLF line endings are kept, as the hash covers them
    except UnicodeDecodeError as exc:
        raise ValueError(f"corpus file {p} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not text.strip():
        raise ValueError(f"corpus file {p} is empty")
    return Corpus(text=text, name=name or p.name, source=str(p), sha256=_sha256(data))


def wikitext2_path(data_dir: str | Path | None = None) -> Path | None:
    """The local WikiText-2 test file under ``data_dir`` or ``$KVSQUEEZE_DATA``, or None."""
    root = data_dir if data_dir is not None else os.environ.get("KVSQUEEZE_DATA")
    if not root:
        return None
    path = Path(root).expanduser() / WIKITEXT2_RELATIVE
    return path if path.is_file() else None


def wikitext2(data_dir: str | Path | None = None) -> Corpus:
    """WikiText-2 raw, test split: the local file if present, else the datasets hub when it is installed."""
    path = wikitext2_path(data_dir)
    if path is not None:
        return load_text_file(path, name="wikitext2")
    try:
        import datasets  # optional; only used when no local copy exists
    except ImportError:
        raise CorpusUnavailable(WIKITEXT2_HOWTO) from None
    try:
        rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"]
    except Exception as exc:  # offline, hub errors: say how to get the file instead
        raise CorpusUnavailable(f"{WIKITEXT2_HOWTO} (hub: {type(exc).__name__}: {exc})") from None
    # The shared file is the rows concatenated with CRLF line endings; rebuild the same bytes.
    text = "".join(rows).replace("\n", "\r\n")
    return Corpus(text=text, name="wikitext2", source="hub:wikitext/wikitext-2-raw-v1/test",
                  sha256=_sha256(text.encode("utf-8")))


def resolve_corpus(text: str | Path | None = None, dataset: str | None = None) -> Corpus:
    """A corpus from ``--text FILE`` or ``--dataset NAME`` (exactly one; WikiText-2 when both are None)."""
    if text is not None and dataset is not None:
        raise ValueError("give either --text FILE or --dataset, not both")
    if text is not None:
        return load_text_file(text)
    dataset = dataset or "wikitext2"
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; allowed: {', '.join(DATASETS)} (or --text FILE)")
    return wikitext2()


def tokenize(corpus: Corpus, tokenizer: Any) -> torch.Tensor:
    """All token ids of the corpus, 1-D int64, without special tokens (no BOS is inserted)."""
    ids = tokenizer(corpus.text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def eval_chunks(ids: torch.Tensor, context: int, chunks: int,
                max_eval_fraction: float = MAX_EVAL_FRACTION) -> torch.Tensor:
    """[chunks, context] consecutive windows from the start; refuses chunks reaching into the calibration tail."""
    if context < 2:
        raise ValueError(f"context must be at least 2 tokens, got {context}")
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}")
    usable = int(ids.numel() * max_eval_fraction)
    need = context * chunks
    if need > usable:
        fit = usable // context
        hint = f"at most --chunks {fit} at this context" if fit else "a shorter --context or a longer corpus"
        raise ValueError(
            f"corpus too short: context {context} x chunks {chunks} = {need} tokens, but only the first "
            f"{usable} of its {ids.numel()} tokens may be evaluated (the last {1 - max_eval_fraction:.0%} is "
            f"reserved for calibration); use {hint}"
        )
    return ids[:need].view(chunks, context)
