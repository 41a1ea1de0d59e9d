"""Corpus resolution, hashing and chunking, including the calibration-slice guard."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvsqueeze import corpus as C

WIKITEXT_SHA256 = "4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c"  # from the data README


def test_text_file_hash_is_of_its_bytes_and_crlf_is_kept(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(b"line one\r\nline two\r\n")
    c = C.load_text_file(path)
    assert c.sha256 == hashlib.sha256(b"line one\r\nline two\r\n").hexdigest()
    assert "\r\n" in c.text and c.name == "t.txt"


def test_wikitext2_from_kvsqueeze_data(monkeypatch, wikitext_path):
    monkeypatch.setenv("KVSQUEEZE_DATA", str(wikitext_path.parents[1]))
    c = C.resolve_corpus(dataset="wikitext2")
    assert c.name == "wikitext2" and c.source == str(wikitext_path)
    assert c.sha256 == WIKITEXT_SHA256


def test_missing_wikitext_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSQUEEZE_DATA", str(tmp_path))
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("no datasets")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(C.CorpusUnavailable, match="KVSQUEEZE_DATA"):
        C.resolve_corpus()


@pytest.mark.parametrize("kwargs, message", [
    ({"text": "a.txt", "dataset": "wikitext2"}, "not both"),
    ({"dataset": "ptb"}, "allowed: wikitext2"),
    ({"text": "/nonexistent/file.txt"}, "not found"),
])
def test_bad_corpus_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        C.resolve_corpus(**kwargs)


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


def test_tokenize_adds_no_special_tokens(tiny_tokenizer):
    c = C.Corpus(text="w5 w6 w7", name="x", source="x", sha256="0")
    assert C.tokenize(c, tiny_tokenizer).tolist() == [5, 6, 7]
