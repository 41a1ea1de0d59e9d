"""Perplexity corpora: where the text comes from, its SHA-256, tokenization and evaluation chunks.

Resolution, in order (the first that works is used, and every step tried is recorded in the corpus, so each
report states how its corpus was found):

1. ``--text FILE``;
2. ``$KVSQUEEZE_DATA/wikitext-2-raw/wiki.test.raw``;
3. the local cache, ``<user cache>/data/wikitext-2-raw/wiki.test.raw`` (``~/.cache/kvsqueeze`` or
   ``$KVSQUEEZE_CACHE``), used only when its SHA-256 is the reference one;
4. online: WikiText-2 fetched once through ``huggingface_hub`` (a dependency of transformers), rebuilt in the
   reference layout, verified against the reference SHA-256 and only then cached; a mismatch is refused;
5. offline (no ``--dataset wikitext2`` asked for): the Python interpreter's own documentation text
   (``pydoc_data.topics``), named ``python-docs`` and hashed as what it is - never as WikiText-2.

Chunks are consecutive, non-overlapping windows of ``context`` tokens taken from the start of the corpus.  The
last 10% of every corpus is reserved for calibration (methods must never be calibrated on the text they are
evaluated on), so chunks that would reach into it are refused rather than silently used.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import platform
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import KvsqueezeError
from .user_cache import user_cache_root

if TYPE_CHECKING:  # torch is imported where tokens are made: the command-line parsers import this module
    import torch

DATASETS = ("wikitext2", "python-docs")
WIKITEXT2_RELATIVE = Path("wikitext-2-raw") / "wiki.test.raw"
# wiki.test.raw as the project uses it: the ordered test split of wikitext-2-raw-v1, its non-empty rows joined
# with CRLF line endings (1,290,547 bytes; /work/shared/data/wikitext-2-raw/README.md)
WIKITEXT2_SHA256 = "4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c"
MAX_EVAL_FRACTION = 0.9  # the tail beyond this fraction of the tokens is the calibration slice
PYTHON_DOCS_DESCRIPTION = ("the Python interpreter's own documentation text (pydoc_data.topics), shipped with "
                           "Python; NOT WikiText-2: its perplexities compare caches within one run, not with "
                           "published WikiText-2 figures")

WIKITEXT2_HOWTO = (
    "WikiText-2 was not found: set KVSQUEEZE_DATA to a folder containing wikitext-2-raw/wiki.test.raw "
    "(in this repository's checkout: KVSQUEEZE_DATA=../shared/data), pass --text FILE, or run once online "
    "(it is then fetched from the Hugging Face hub and cached)"
)


class CorpusUnavailable(KvsqueezeError):
    """The requested corpus cannot be found (a ValueError, so the CLI reports it in one line)."""


class CorpusIntegrityError(KvsqueezeError):
    """Fetched or cached text that does not have the reference SHA-256: refused, never cached or used."""


@dataclass(frozen=True)
class Corpus:
    text: str
    name: str  # "wikitext2", "python-docs" or the file name
    source: str  # where it was read from: a path, "hub:<repo>/<file>" or "pydoc_data.topics (Python x.y.z)"
    sha256: str  # of the UTF-8 bytes of ``text`` (for a file: the file itself, byte for byte)
    description: str = ""  # what the text is, in words
    resolution: tuple[str, ...] = ()  # every step of the resolution tried, in order, and what it gave
    reference_sha256: str | None = None  # the hash this corpus is known by, where there is one

    def describe(self) -> dict[str, Any]:
        verified = None if self.reference_sha256 is None else self.sha256 == self.reference_sha256
        return {"name": self.name, "source": self.source, "sha256": self.sha256, "chars": len(self.text),
                "description": self.description, "resolution": list(self.resolution),
                "matches_reference_sha256": verified}


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
        raise KvsqueezeError(f"corpus file {p} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not text.strip():
        raise KvsqueezeError(f"corpus file {p} is empty")
    return Corpus(text=text, name=name or p.name, source=str(p), sha256=_sha256(data),
                  description="a text file given with --text", resolution=(f"--text FILE: {p}",))


# ------------------------------------------------------------------------------------------------ WikiText-2
def wikitext2_path(data_dir: str | Path | None = None) -> Path | None:
    """The local WikiText-2 test file under ``data_dir`` or ``$KVSQUEEZE_DATA``, or None."""
    root = data_dir if data_dir is not None else os.environ.get("KVSQUEEZE_DATA")
    if not root:
        return None
    path = Path(root).expanduser() / WIKITEXT2_RELATIVE
    return path if path.is_file() else None


def wikitext2_cache_path() -> Path:
    """Where a verified download is kept: laid out like ``$KVSQUEEZE_DATA``, so the folder can serve as one."""
    return user_cache_root() / "data" / WIKITEXT2_RELATIVE


def rows_to_reference_layout(rows: list[str]) -> str:
    """The test split's rows (lines with their "\\n"; blank lines as "") as the reference file: CRLF endings."""
    return "".join(rows).replace("\n", "\r\n")


def _text_from_parquet(path: Path) -> str:
    import pyarrow.parquet as pq  # only when installed (HubSource.needs)

    return rows_to_reference_layout(pq.read_table(path, columns=["text"]).column("text").to_pylist())


def _text_from_original_zip(path: Path) -> str:
    """The original release (wikitext-2-raw-v1.zip): its test file read line by line as the hub's rows were
    made (text mode, whitespace-only lines dropped), then in the reference layout."""
    with zipfile.ZipFile(path) as z:
        data = z.read("wikitext-2-raw/wiki.test.raw")
    with io.TextIOWrapper(io.BytesIO(data), encoding="utf-8") as f:
        rows = [row if row.strip() else "" for row in f]
    return rows_to_reference_layout(rows)


@dataclass(frozen=True)
class HubSource:
    repo_id: str  # a dataset repository on the Hugging Face hub
    filename: str
    extract: Callable[[Path], str]  # the downloaded file -> wiki.test.raw text in the reference layout
    needs: str | None = None  # a module the extraction needs; the source is skipped when it is not installed

    @property
    def label(self) -> str:
        return f"hub:{self.repo_id}/{self.filename}"


HUB_SOURCES = (
    # the canonical dataset (what the reference file was built from); parquet needs pyarrow, not installed by us
    HubSource("Salesforce/wikitext", "wikitext-2-raw-v1/test-00000-of-00001.parquet", _text_from_parquet, "pyarrow"),
    # the original release archive as llama.cpp's scripts fetch it: read with the standard library alone
    HubSource("ggml-org/ci", "wikitext-2-raw-v1.zip", _text_from_original_zip),
)


def _hub_download(repo_id: str, filename: str) -> Path:
    """The one network call: a dataset file through huggingface_hub (its own cache; HF_HUB_OFFLINE honoured)."""
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo_id=repo_id, filename=filename, repo_type="dataset"))


def _unreachable(exc: Exception) -> bool:
    """The hub cannot be reached at all (offline mode, no network): trying another file is pointless."""
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    return isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled, ConnectionError))


def _short(exc: Exception) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:160]}"


def _cache(path: Path, data: bytes) -> str:
    """Keep a verified download; a cache that cannot be written (full disk, read-only) only costs a re-download
    next time: one warning line, the run goes on."""
    from .atomic_dir import write_file_atomic
    from .errors import DiskWriteError

    try:
        write_file_atomic(path, data)
    except DiskWriteError as exc:
        print(f"kvsqueeze: warning: corpus not cached: {exc}", file=sys.stderr)
        return f"not cached ({exc})"
    return f"cached at {path}"


def fetch_wikitext2(steps: list[str]) -> Corpus | None:
    """WikiText-2 from the hub, verified and cached; None when no source could be reached.  A download that
    does not rebuild the reference bytes is refused (CorpusIntegrityError), never cached."""
    mismatches = []
    for src in HUB_SOURCES:
        if src.needs and importlib.util.find_spec(src.needs) is None:
            steps.append(f"{src.label}: skipped ({src.needs} is not installed)")
            continue
        try:
            text = src.extract(_hub_download(src.repo_id, src.filename))
        except Exception as exc:  # network, hub and archive errors alike: say which, try the next source
            if _unreachable(exc):
                offline = ", HF_HUB_OFFLINE is set" if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") else ""
                steps.append(f"{src.label}: the hub cannot be reached ({type(exc).__name__}{offline})")
                break
            steps.append(f"{src.label}: {_short(exc)}")
            continue
        data = text.encode("utf-8")
        digest = _sha256(data)
        if digest != WIKITEXT2_SHA256:
            steps.append(f"{src.label}: refused, sha256 {digest[:16]}… is not the reference {WIKITEXT2_SHA256[:16]}…")
            mismatches.append(src.label)
            continue
        cache = wikitext2_cache_path()
        steps.append(f"{src.label}: fetched, sha256 verified, {_cache(cache, data)}")
        return Corpus(text=text, name="wikitext2", source=src.label, sha256=digest,
                      description="WikiText-2 raw, test split", resolution=tuple(steps),
                      reference_sha256=WIKITEXT2_SHA256)
    if mismatches:
        raise CorpusIntegrityError(
            f"WikiText-2 from {', '.join(mismatches)} does not have the reference SHA-256 {WIKITEXT2_SHA256} and "
            f"was refused (nothing cached); {WIKITEXT2_HOWTO.split(': ', 1)[1]}")
    return None


def wikitext2(data_dir: str | Path | None = None, steps: list[str] | None = None) -> Corpus:
    """WikiText-2 raw, test split: ``$KVSQUEEZE_DATA`` (or ``data_dir``), else the verified local cache, else
    fetched from the hub once.  ``steps`` collects what each step gave (the corpus's ``resolution``)."""
    steps = [] if steps is None else steps
    root = data_dir if data_dir is not None else os.environ.get("KVSQUEEZE_DATA")
    path = wikitext2_path(root) if root else None
    if path is not None:
        c = load_text_file(path, name="wikitext2")
        note = "" if c.sha256 == WIKITEXT2_SHA256 else " (its sha256 is not the reference one; used as given)"
        steps.append(f"$KVSQUEEZE_DATA: {path}{note}")
        return Corpus(text=c.text, name="wikitext2", source=c.source, sha256=c.sha256,
                      description="WikiText-2 raw, test split", resolution=tuple(steps),
                      reference_sha256=WIKITEXT2_SHA256)
    steps.append("$KVSQUEEZE_DATA: not set" if not root else f"$KVSQUEEZE_DATA: no {WIKITEXT2_RELATIVE} under {root}")
    cache = wikitext2_cache_path()
    if cache.is_file():
        data = cache.read_bytes()
        if _sha256(data) == WIKITEXT2_SHA256:
            steps.append(f"local cache: {cache}, sha256 verified")
            return Corpus(text=data.decode("utf-8"), name="wikitext2", source=str(cache), sha256=WIKITEXT2_SHA256,
                          description="WikiText-2 raw, test split", resolution=tuple(steps),
                          reference_sha256=WIKITEXT2_SHA256)
        steps.append(f"local cache: {cache} refused (sha256 is not the reference one)")
    else:
        steps.append(f"local cache: no {cache}")
    fetched = fetch_wikitext2(steps)
    if fetched is None:
        raise CorpusUnavailable(f"{WIKITEXT2_HOWTO} (tried: {'; '.join(steps)})")
    return fetched


# ------------------------------------------------------------------------------------------------ fallback
def python_docs(steps: list[str] | None = None) -> Corpus:
    """The interpreter's documentation topics (``pydoc_data.topics``), in sorted topic order: a corpus every
    Python installation ships.  Its bytes, and so its hash, depend on the Python version, which is named."""
    steps = [] if steps is None else steps
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # some distributions strip pydoc_data
        steps.append(f"python-docs: {_short(exc)}")
        raise CorpusUnavailable(f"no corpus: pydoc_data is missing from this Python and {WIKITEXT2_HOWTO} "
                                f"(tried: {'; '.join(steps)})") from None
    text = "\n\n".join(topics[key] for key in sorted(topics))
    source = f"pydoc_data.topics (Python {platform.python_version()}, {len(topics)} topics)"
    steps.append(f"python-docs: {source}")
    return Corpus(text=text, name="python-docs", source=source, sha256=_sha256(text.encode("utf-8")),
                  description=PYTHON_DOCS_DESCRIPTION, resolution=tuple(steps))


def resolve_corpus(text: str | Path | None = None, dataset: str | None = None) -> Corpus:
    """A corpus from ``--text FILE`` or ``--dataset NAME`` (at most one).  With neither: WikiText-2 as
    :func:`wikitext2` finds it, else (offline, or a download refused) the Python documentation corpus."""
    if text is not None and dataset is not None:
        raise KvsqueezeError("give either --text FILE or --dataset, not both")
    if text is not None:
        return load_text_file(text)
    if dataset is not None and dataset not in DATASETS:
        raise KvsqueezeError(f"unknown dataset {dataset!r}; allowed: {', '.join(DATASETS)} (or --text FILE)")
    steps = ["--text FILE: not given"]
    if dataset == "python-docs":
        return python_docs([*steps, "--dataset python-docs"])
    if dataset == "wikitext2":  # asked for by name: no fallback, a missing or refused download is an error
        return wikitext2(steps=steps)
    try:
        return wikitext2(steps=steps)
    except (CorpusUnavailable, CorpusIntegrityError):
        return python_docs(steps)  # the steps say why WikiText-2 was not used


def summary(corpus: Corpus) -> str:
    """One line naming the corpus, what it is and its hash (printed by the commands)."""
    return f"{corpus.name}: {corpus.description} ({corpus.source}, sha256 {corpus.sha256[:16]}…)"


# ------------------------------------------------------------------------------------------------ tokens
def tokenize(corpus: Corpus, tokenizer: Any) -> torch.Tensor:
    """All token ids of the corpus, 1-D int64, without special tokens (no BOS is inserted)."""
    import torch

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
