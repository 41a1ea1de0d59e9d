"""The harness on the real embedded model and WikiText-2 (slow: loads SmolLM2-135M)."""

from __future__ import annotations

import math

import pytest
import torch

from kvsqueeze import QuantizedCache
from kvsqueeze import corpus as C
from kvsqueeze.eval import protocols as P
from kvsqueeze.eval.ppl import run_ppl


def test_embedded_full_ppl_matches_transformers_and_window_matches_decode(embedded, wikitext_path):
    model, tokenizer = embedded
    text = C.load_text_file(wikitext_path)
    ids = C.tokenize(C.Corpus(text.text[:20000], "head", "head", text.sha256), tokenizer)
    chunks = C.eval_chunks(ids, 256, 1)
    with torch.no_grad():
        loss = model(chunks, labels=chunks).loss
    assert run_ppl(model, chunks, "full", "window")["ppl"] == pytest.approx(math.exp(float(loss)), rel=1e-4)
    # kivi-2 with 4 sinks, 128-token window, 32-token key groups: 64 decode steps after a 192-token prefill
    window = P.nll_window(model, chunks, QuantizedCache(model.config, "kivi-2-sink4").spec, 192)
    decode = P.nll_decode(model, chunks, QuantizedCache(model.config, "kivi-2-sink4"), 192)
    assert abs(math.exp(float(window.mean())) / math.exp(float(decode.mean())) - 1) < 1e-3
