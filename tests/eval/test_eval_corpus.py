"""Corpus resolution (each branch), hashing, the report's wording and chunking, including the calibration-slice
guard on every corpus.  The network is replaced only at the one fetch call, ``corpus._hub_download``."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest
import torch
from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

from kvsqueeze import corpus as C
from kvsqueeze.calibrate.collect import corpus_samples
from kvsqueeze.eval import report

from .conftest import byte_tokenizer

WIKITEXT_SHA256 = "4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c"  # from the data README
ZIP = ("ggml-org/ci", "wikitext-2-raw-v1.zip")


@pytest.fixture
def clean(monkeypatch, tmp_path):
    """No $KVSQUEEZE_DATA, an empty kvsqueeze cache, and a hub that cannot be reached (as the real client
    reports it offline) unless a test installs its own fetch."""
    monkeypatch.delenv("KVSQUEEZE_DATA", raising=False)
    monkeypatch.setenv("KVSQUEEZE_CACHE", str(tmp_path / "cache"))
    calls = []

    def offline(repo_id, filename):
        calls.append((repo_id, filename))
        raise LocalEntryNotFoundError("cannot reach the hub and the file is not in the local cache")

    monkeypatch.setattr(C, "_hub_download", offline)
    return calls


def original_release_zip(wikitext_path: Path, path: Path, edit: bytes = b"") -> Path:
    """wikitext-2-raw-v1.zip as the original release lays its test file out: LF endings and whitespace-only
    lines (" \\n") around headings, which the hub's rows (and the reference file) leave out."""
    lines = wikitext_path.read_bytes().split(b"\r\n")[:-1]
    out = [b" "]
    for line in lines:
        heading = line.startswith(b" = ")
        out += [b" ", line, b" "] if heading else [line]
    data = b"\n".join(out) + b"\n"
    if edit:
        data = data.replace(b"Robert Boulter", edit, 1)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("wikitext-2-raw/wiki.train.raw", " \n = Not the test split = \n")
        z.writestr("wikitext-2-raw/wiki.test.raw", data)
    return path


def serve(monkeypatch, files: dict[tuple[str, str], Path]) -> list[tuple[str, str]]:
    """A hub that has exactly ``files`` (others: not found, as a reachable hub answers)."""
    calls = []

    def download(repo_id, filename):
        calls.append((repo_id, filename))
        if (repo_id, filename) not in files:
            raise EntryNotFoundError(f"{filename} not found in {repo_id}")
        return files[(repo_id, filename)]

    monkeypatch.setattr(C, "_hub_download", download)
    return calls


def python_docs_reference() -> tuple[str, str]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return text, hashlib.sha256(text.encode("utf-8")).hexdigest()


# ------------------------------------------------------------------------------------------------ resolution
def test_text_file_hash_is_of_its_bytes_and_crlf_is_kept(tmp_path, clean):
    path = tmp_path / "t.txt"
    path.write_bytes(b"line one\r\nline two\r\n")
    c = C.resolve_corpus(text=path)
    assert c.sha256 == hashlib.sha256(b"line one\r\nline two\r\n").hexdigest()
    assert "\r\n" in c.text and c.name == "t.txt"
    assert c.resolution == (f"--text FILE: {path}",) and not clean  # nothing else was tried


def test_wikitext2_from_kvsqueeze_data(monkeypatch, wikitext_path, clean):
    monkeypatch.setenv("KVSQUEEZE_DATA", str(wikitext_path.parents[1]))
    c = C.resolve_corpus()
    assert c.name == "wikitext2" and c.source == str(wikitext_path)
    assert c.sha256 == WIKITEXT_SHA256 and c.describe()["matches_reference_sha256"] is True
    assert c.resolution == ("--text FILE: not given", f"$KVSQUEEZE_DATA: {wikitext_path}")
    assert not clean


def test_wikitext2_from_the_local_cache(tmp_path, wikitext_path, clean):
    cached = tmp_path / "cache" / "data" / "wikitext-2-raw" / "wiki.test.raw"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(wikitext_path.read_bytes())
    c = C.resolve_corpus()
    assert (c.name, c.source, c.sha256) == ("wikitext2", str(cached), WIKITEXT_SHA256)
    assert c.resolution[-1] == f"local cache: {cached}, sha256 verified" and not clean


def test_a_corrupt_cache_is_not_used(tmp_path, clean):
    cached = tmp_path / "cache" / "data" / "wikitext-2-raw" / "wiki.test.raw"
    cached.parent.mkdir(parents=True)
    cached.write_text(" = Robert Boulter = \r\n truncated\r\n")
    c = C.resolve_corpus()
    assert c.name == "python-docs"
    assert f"local cache: {cached} refused (sha256 is not the reference one)" in c.resolution


def test_online_fetch_is_verified_cached_and_fetched_once(tmp_path, monkeypatch, wikitext_path, clean):
    calls = serve(monkeypatch, {ZIP: original_release_zip(wikitext_path, tmp_path / "w.zip")})
    c = C.resolve_corpus()
    assert (c.name, c.source, c.sha256) == ("wikitext2", "hub:ggml-org/ci/wikitext-2-raw-v1.zip", WIKITEXT_SHA256)
    assert c.text.encode("utf-8") == wikitext_path.read_bytes()  # the reference file, byte for byte
    cached = tmp_path / "cache" / "data" / "wikitext-2-raw" / "wiki.test.raw"
    assert cached.read_bytes() == wikitext_path.read_bytes()
    assert calls[-1] == ZIP and c.resolution[-1].endswith(f"sha256 verified, cached at {cached}")
    n = len(calls)
    again = C.resolve_corpus(dataset="wikitext2")
    assert len(calls) == n and again.source == str(cached)  # the second run reads the cache, no download


def test_hub_rows_rebuild_the_reference_file(wikitext_path):
    """The parquet route's join: the test split's rows (blank lines as "") give the reference bytes."""
    rows = []
    for line in wikitext_path.read_bytes().decode("utf-8").split("\r\n")[:-1]:
        rows += ["", line + "\n", ""] if line.startswith(" = ") else [line + "\n"]
    assert hashlib.sha256(C.rows_to_reference_layout(rows).encode("utf-8")).hexdigest() == WIKITEXT_SHA256


def test_offline_falls_back_to_the_corpus_python_ships(clean, tmp_path):
    c = C.resolve_corpus()
    text, sha = python_docs_reference()
    assert (c.name, c.text, c.sha256) == ("python-docs", text, sha)
    assert "NOT WikiText-2" in c.description and c.describe()["matches_reference_sha256"] is None
    cache = tmp_path / "cache" / "data" / "wikitext-2-raw" / "wiki.test.raw"
    assert c.resolution[:3] == ("--text FILE: not given", "$KVSQUEEZE_DATA: not set", f"local cache: no {cache}")
    # CI sets HF_HUB_OFFLINE=1, which the message then names too
    assert c.resolution[-2] in (f"hub:ggml-org/ci/wikitext-2-raw-v1.zip: the hub cannot be reached ({why})"
                                for why in ("LocalEntryNotFoundError", "LocalEntryNotFoundError, HF_HUB_OFFLINE is set"))
    assert c.resolution[-1].startswith("python-docs: pydoc_data.topics (Python ")
    assert clean[-1] == ZIP and len(clean) == 1  # one unreachable hub is not asked again for another file
    with pytest.raises(C.CorpusUnavailable, match="KVSQUEEZE_DATA.*tried: .*cannot be reached"):
        C.resolve_corpus(dataset="wikitext2")  # asked for by name: no fallback
    assert C.resolve_corpus(dataset="python-docs").sha256 == sha


def test_real_hub_client_in_offline_mode(monkeypatch, tmp_path):
    """The unmocked fetch with huggingface_hub's own offline mode and an empty hub cache: no network, a fallback."""
    import huggingface_hub.constants as hub

    monkeypatch.delenv("KVSQUEEZE_DATA", raising=False)
    monkeypatch.setenv("KVSQUEEZE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hf"))
    c = C.resolve_corpus()
    assert c.name == "python-docs" and "the hub cannot be reached" in c.resolution[-2]


def test_a_download_with_another_hash_is_refused_and_not_cached(tmp_path, monkeypatch, wikitext_path, clean):
    serve(monkeypatch, {ZIP: original_release_zip(wikitext_path, tmp_path / "w.zip", edit=b"Robert Bolter")})
    with pytest.raises(C.CorpusIntegrityError, match="does not have the reference SHA-256.*refused"):
        C.resolve_corpus(dataset="wikitext2")
    assert not (tmp_path / "cache").exists()
    c = C.resolve_corpus()  # without --dataset: the refusal is recorded and the run goes on, on python-docs
    assert c.name == "python-docs" and not (tmp_path / "cache").exists()
    assert any(s.startswith("hub:ggml-org/ci/wikitext-2-raw-v1.zip: refused, sha256 ") for s in c.resolution)


def test_without_pydoc_data_the_how_to_is_given(clean, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "pydoc_data.topics", None)
    with pytest.raises(C.CorpusUnavailable, match="pydoc_data is missing.*KVSQUEEZE_DATA"):
        C.resolve_corpus()


@pytest.mark.parametrize("kwargs, message", [
    ({"text": "a.txt", "dataset": "wikitext2"}, "not both"),
    ({"dataset": "ptb"}, "allowed: wikitext2, python-docs"),
    ({"text": "/nonexistent/file.txt"}, "not found"),
])
def test_bad_corpus_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        C.resolve_corpus(**kwargs)


# ------------------------------------------------------------------------------------------------ reports
def test_report_names_the_fallback_corpus_as_what_it_is(clean):
    c = C.resolve_corpus()
    meta = {"command": "kvsqueeze bench --quick", "date": "d", "wall_seconds": 60.0, "expected_seconds": 60.0,
            "threads": 1, "corpus": {**c.describe(), "tokens": 1000},
            "machine": {"cpu": "x", "cpus_available": 2, "memory_gib": 1, "platform": "p", "gpu": None,
                        "python": "3", "versions": {}},
            "model": {"name": "m", "architecture": "a", "num_layers": 1, "num_heads": 1, "num_kv_heads": 1,
                      "head_dim": 64, "dtype": "float32", "parameters": 1e6}}
    cfg = {"quick": True, "speed_contexts": [32], "ppl_chunks": 2, "ppl_context": 64, "ppl_decode_tokens": 8,
           "speed_decode_tokens": 2}
    md = report.markdown({"meta": meta, "config": cfg, "caches": []})
    line = next(x for x in md.splitlines() if x.startswith("- Corpus: "))
    assert line.startswith("- Corpus: python-docs (the Python interpreter's own documentation text")
    assert "NOT WikiText-2" in line and f"sha256 `{c.sha256[:16]}…`" in line and "wikitext2" not in line
    resolution = next(x for x in md.splitlines() if x.startswith("- Corpus resolution"))
    assert "$KVSQUEEZE_DATA: not set" in resolution and resolution.endswith(c.resolution[-1])


# ------------------------------------------------------------------------------------------------ chunks
def test_chunks_are_consecutive_from_the_start():
    ids = torch.arange(1000)
    chunks = C.eval_chunks(ids, 100, 9)
    assert chunks.shape == (9, 100)
    assert torch.equal(chunks.flatten(), torch.arange(900))


def test_chunks_never_reach_the_calibration_tail():
    ids = torch.arange(1000)
    with pytest.raises(ValueError, match=r"only the first 900 of its 1000 tokens.*at most --chunks 9"):
        C.eval_chunks(ids, 100, 10)
    with pytest.raises(ValueError, match="shorter --context"):
        C.eval_chunks(ids, 950, 1)


def test_split_rule_holds_on_the_fallback_corpus(clean):
    c = C.resolve_corpus()
    tok = byte_tokenizer()
    ids = C.tokenize(c, tok)
    n = ids.numel()
    assert n == len(c.text.encode("utf-8"))  # one token per byte
    limit = int(n * 0.9)
    fit = limit // 4096
    assert torch.equal(C.eval_chunks(ids, 4096, fit).flatten(), ids[: fit * 4096])
    with pytest.raises(ValueError, match=f"only the first {limit} of its {n} tokens"):
        C.eval_chunks(ids, 4096, fit + 1)
    data = corpus_samples(c, tok, samples=3, length=512)
    assert data.provenance["token_start"] == limit and data.provenance["disjoint_from_evaluation"]
    assert data.provenance["name"] == "python-docs" and data.provenance["sha256"] == c.sha256
    assert torch.equal(data.ids.flatten(), ids[limit: limit + 3 * 512])


def test_tokenize_adds_no_special_tokens(tiny_tokenizer):
    c = C.Corpus(text="w5 w6 w7", name="x", source="x", sha256="0")
    assert C.tokenize(c, tiny_tokenizer).tolist() == [5, 6, 7]
