"""Passkey prompts and the exact scorer."""

from __future__ import annotations

import pytest

from kvsqueeze.eval import retrieval as R

from .conftest import byte_tokenizer


@pytest.mark.parametrize("answer, correct", [
    (" 71432.", True),
    ("71432", True),
    (" 71432 is the pass key", True),
    (" the number 71432.", True),
    (" 7143", False),  # truncated
    (" 714321", False),  # longer number
    (" 71,432", False),  # split by punctuation: the first number is 71
    (" 12345. Also 71432", False),  # the first number counts
    (" no idea", False),
    ("", False),
])
def test_score_answer(answer, correct):
    assert R.score_answer(answer, "71432") is correct


def test_parse_lengths_and_depths():
    assert R.parse_lengths("1k,2k, 1500") == [1024, 2048, 1500]
    assert R.parse_depths("0,0.25,1.0") == [0.0, 0.25, 1.0]
    for bad in ("0", "1m", "x", ""):
        with pytest.raises(ValueError):
            R.parse_lengths(bad)
    for bad in ("1.5", "-0.1", "half"):
        with pytest.raises(ValueError):
            R.parse_depths(bad)


def test_passkeys_are_deterministic_five_digit_numbers():
    keys = {R.passkey_for(n, d, t) for n in (1024, 2048) for d in (0.0, 0.5) for t in range(3)}
    assert len(keys) > 6 and all(len(k) == 5 and k.isdigit() for k in keys)
    assert R.passkey_for(1024, 0.5, 0) == R.passkey_for(1024, 0.5, 0)


@pytest.mark.parametrize("fmt", ["plain", "chat"])
def test_prompt_fits_the_length_and_places_the_needle_at_its_depth(fmt):
    tok = byte_tokenizer()
    if fmt == "chat":
        tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    b = R.PromptBuilder(tok, R.filler_sentences(), fmt)
    needle = R.NEEDLE.format(key="55555")
    positions = []
    for depth in (0.0, 0.5, 1.0):
        text = tok.decode(b.ids(2000, depth, "55555"))
        assert 1900 < len(b.ids(2000, depth, "55555")) <= 2000 - R.MAX_NEW_TOKENS
        assert text.count(needle) == 1 and text.rstrip().endswith(R.ANSWER_PREFIX)
        positions.append(text.index(needle) / len(text))
    assert positions[0] < 0.1 and 0.4 < positions[1] < 0.6 and positions[2] > 0.9
    with pytest.raises(ValueError, match="too short"):
        b.ids(50, 0.5, "55555")


def test_corpus_haystack_uses_its_sentences():
    sents = R.filler_sentences("First long sentence of the corpus here. Second long sentence of the corpus.")
    assert sents == ["First long sentence of the corpus here.", "Second long sentence of the corpus."]


def test_accuracy_grid_averages_trials():
    cells = [{"length": 1, "depth": 0.0, "correct": True}, {"length": 1, "depth": 0.0, "correct": False},
             {"length": 1, "depth": 1.0, "correct": True}]
    assert R.accuracy_grid(cells, [1], [0.0, 1.0]) == [[0.5], [1.0]]
