"""Passkey retrieval (needle in a haystack): prompt builder, exact scorer and the runner.

A 5-digit pass key sentence is hidden at a relative depth of a haystack (package-generated filler sentences,
or sentences of a corpus) of a given length in tokens; the prompt ends with the question and the start of
the answer.  The model decodes greedily through the cache under test and the answer is correct when the
first number it writes is exactly the pass key.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..spec import DEFAULT_PREFILL_CHUNK

INTRO = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will ask you for the pass key at the end.\n")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key?"
ANSWER_PREFIX = "The pass key is"
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
          "There and back again.")
FORMATS = ("plain", "chat")
MAX_NEW_TOKENS = 12


def parse_lengths(text: str) -> list[int]:
    """"1k,2k,4k" or "1024,3000" -> token counts (k = 1024)."""
    out = []
    for item in (s.strip().lower() for s in text.split(",") if s.strip()):
        m = re.fullmatch(r"(\d+)(k?)", item)
        if not m or int(m[1]) == 0:
            raise ValueError(f"bad length {item!r}: use positive token counts like 1k,2k,4k or 1500")
        out.append(int(m[1]) * (1024 if m[2] else 1))
    if not out:
        raise ValueError("no lengths given; e.g. --lengths 1k,2k,4k")
    return out


def parse_depths(text: str) -> list[float]:
    out = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        try:
            d = float(item)
        except ValueError:
            d = -1.0
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"bad depth {item!r}: depths are fractions in [0, 1], e.g. 0,0.25,0.5,0.75,1")
        out.append(d)
    if not out:
        raise ValueError("no depths given; e.g. --depths 0,0.5,1")
    return out


def passkey_for(length: int, depth: float, trial: int) -> str:
    """Deterministic 5-digit key per (length, depth, trial): every cache is asked the same questions."""
    return str(random.Random(f"{length}/{depth:.4f}/{trial}").randint(10000, 99999))


def score_answer(answer: str, passkey: str) -> bool:
    """Exact: the first number in the answer is the pass key (a longer or shorter number is wrong)."""
    m = re.search(r"\d+", answer)
    return m is not None and m.group() == passkey


def generated_haystack() -> dict[str, Any]:
    """What a report says of the default haystack: no corpus, the package's own filler, and its hash."""
    import hashlib

    return {"name": "generated", "source": "kvsqueeze.eval.retrieval.FILLER",
            "description": "kvsqueeze's own filler sentences, repeated (no corpus is read)",
            "sha256": hashlib.sha256("\n".join(FILLER).encode("utf-8")).hexdigest()}


def filler_sentences(corpus_text: str | None = None) -> list[str]:
    """The haystack's sentences: the package's own filler, or the sentences of a corpus (in order)."""
    if corpus_text is None:
        return list(FILLER)
    sents = [s.strip().rstrip(".") + "." for s in re.split(r"\.\s+", " ".join(corpus_text.split())) if len(s.strip()) > 20]
    if not sents:
        raise ValueError("the haystack corpus has no usable sentences")
    return sents


@dataclass(frozen=True)
class PromptBuilder:
    tokenizer: Any
    sentences: Sequence[str]
    fmt: str = "plain"

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown prompt format {self.fmt!r}; allowed: {', '.join(FORMATS)}")
        if self.fmt == "chat" and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("prompt format 'chat' needs a tokenizer with a chat template; use 'plain'")

    def _text(self, n: int, depth: float, key: str) -> str:
        hay = [self.sentences[i % len(self.sentences)] for i in range(n)]
        hay.insert(round(depth * n), NEEDLE.format(key=key))
        body = INTRO + " ".join(hay) + "\n"
        if self.fmt == "plain":
            return f"{body}{QUESTION} {ANSWER_PREFIX}"
        chat = self.tokenizer.apply_chat_template([{"role": "user", "content": body + QUESTION}], tokenize=False,
                                                  add_generation_prompt=True)
        return chat + ANSWER_PREFIX

    def ids(self, length: int, depth: float, key: str) -> list[int]:
        """Token ids of the longest prompt (the most filler sentences) that leaves room for the answer:
        prompt + ``MAX_NEW_TOKENS`` fit in ``length`` tokens, so a length equal to the model's context works."""
        budget = length - MAX_NEW_TOKENS

        def count(n: int) -> list[int]:
            return self.tokenizer(self._text(n, depth, key), add_special_tokens=False, verbose=False)["input_ids"]

        lo, hi = 0, 1
        while len(count(hi)) <= budget:
            lo, hi = hi, hi * 2
        if lo == 0 and len(count(0)) > budget:
            raise ValueError(f"length {length} is too short for the passkey prompt itself ({len(count(0))} tokens "
                             f"+ {MAX_NEW_TOKENS} for the answer)")
        while hi - lo > 1:  # the largest n whose prompt fits
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if len(count(mid)) <= budget else (lo, mid)
        return count(lo)


@torch.no_grad()
def greedy_answer(model: Any, tokenizer: Any, ids: list[int], cache: Any, max_new_tokens: int = MAX_NEW_TOKENS,
                  prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> str:
    """Greedy decoding through ``cache`` (the prompt prefilled ``prefill_chunk`` tokens per pass, 0 = one pass);
    stops at EOS or once a number has been written and followed by more."""
    from ..adapter import cache_kwargs
    from .peers import prefill

    head = model.get_output_embeddings()
    h = prefill(model, torch.tensor([ids]), cache, prefill_chunk)
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(head(h).argmax(-1))
        if nxt == tokenizer.eos_token_id:
            break
        out.append(nxt)
        text = tokenizer.decode(out)
        if re.search(r"\d\D", text):
            break
        h = model.base_model(input_ids=torch.tensor([[nxt]]), **cache_kwargs(model.base_model, cache),
                             use_cache=True).last_hidden_state[:, -1]
    return tokenizer.decode(out)


def cells(lengths: Sequence[int], depths: Sequence[float], trials: int) -> Iterator[tuple[int, float, int]]:
    for length in lengths:
        for depth in depths:
            for trial in range(trials):
                yield length, depth, trial


def run_retrieval(model: Any, tokenizer: Any, kv: str, lengths: Sequence[int], depths: Sequence[float],
                  trials: int = 1, fmt: str = "plain", corpus_text: str | None = None,
                  progress: Any = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> dict[str, Any]:
    """Accuracy per (length, depth) of the cache ``kv`` (a preset, spec or peer name); prompts prefilled
    ``prefill_chunk`` tokens per forward pass (0 = one pass)."""
    from .peers import make_cache

    builder = PromptBuilder(tokenizer, filler_sentences(corpus_text), fmt)
    results = []
    for length, depth, trial in cells(lengths, depths, trials):
        key = passkey_for(length, depth, trial)
        ids = builder.ids(length, depth, key)
        answer = greedy_answer(model, tokenizer, ids, make_cache(model, kv), prefill_chunk=prefill_chunk)
        results.append({"length": length, "depth": depth, "trial": trial, "prompt_tokens": len(ids),
                        "passkey": key, "answer": answer, "correct": score_answer(answer, key)})
        if progress is not None:
            progress.update(1)
    return {"kv": kv, "format": fmt, "haystack": "corpus" if corpus_text is not None else "generated",
            "trials": trials, "prefill_chunk": prefill_chunk, "lengths": list(lengths), "depths": list(depths),
            "accuracy": accuracy_grid(results, lengths, depths),
            "mean_accuracy": sum(r["correct"] for r in results) / len(results), "cells": results}


def accuracy_grid(results: Sequence[dict[str, Any]], lengths: Sequence[int],
                  depths: Sequence[float]) -> list[list[float]]:
    """accuracy[i_depth][i_length], the mean over trials."""
    grid = []
    for d in depths:
        row = []
        for n in lengths:
            hits = [r["correct"] for r in results if r["length"] == n and r["depth"] == d]
            row.append(sum(hits) / len(hits) if hits else float("nan"))
        grid.append(row)
    return grid
