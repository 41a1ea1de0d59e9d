"""README's first example runs as written on this transformers, warns about nothing, and shows quantization at work
(codes and scales with bytes, the quantized part's bits)."""

from __future__ import annotations

import contextlib
import io
import logging
import re
import warnings

from conftest import REPO_ROOT, requires_embedded


def readme_examples() -> list[str]:
    """README's python code blocks, in order."""
    return re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)


def readme_example() -> str:
    return readme_examples()[0]


def as_this_transformers_names_it(code: str) -> str:
    """README's code with the cache argument this transformers takes (``past_key_values=`` before 5.24, as README
    says)."""
    from kvsqueeze.adapter import cache_arg

    return code if cache_arg() == "cache" else code.replace("cache=cache", "past_key_values=cache")


def test_readme_example_names_the_current_cache_argument():
    code = readme_example()
    assert "cache=cache" in code and "past_key_values" not in code
    assert "cache.summary()" in code


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@requires_embedded
def test_readme_example_runs_without_warnings():
    from transformers.utils import logging as hf_logging

    code = as_this_transformers_names_it(readme_example())
    # transformers logs its deprecations once per process (warning_once): forget earlier ones so this run shows them
    hf_logging.warning_once.cache_clear() if hasattr(hf_logging.warning_once, "cache_clear") else None
    records = _Records()
    hf = logging.getLogger("transformers")
    hf.addHandler(records)
    out = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(out):
            warnings.simplefilter("error")  # a FutureWarning/DeprecationWarning fails the test
            exec(compile(code, "README.md", "exec"), {})
    finally:
        hf.removeHandler(records)
    assert records.messages == []
    last = out.getvalue().strip().splitlines()[-1]
    m = re.fullmatch(r"(\d+) tokens: (\d+) quantized, (\d+) in the 128-token full-precision window; KV cache "
                     r"[\d.]+ MiB \(codes ([\d.]+), scales/zeros ([\d.]+), full precision [\d.]+\) = [\d.]+ "
                     r"bits/element overall, quantized part ([\d.]+) bits/element", last)
    assert m, last
    n, q, w = (int(m[i]) for i in (1, 2, 3))
    assert n == q + w and q > 0, last
    assert float(m[4]) > 0 and float(m[5]) > 0, last
    assert 2 < float(m[6]) <= 3, last  # 2-bit codes plus an fp16 scale and zero per 32 elements


@requires_embedded
def test_readme_static_cache_example_runs():
    """The second example (StaticQuantizedCache) runs after the first, in its namespace, and stores its tokens."""
    first, second = readme_examples()[:2]
    ns: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(as_this_transformers_names_it(first), "README.md", "exec"), ns)
        exec(compile(as_this_transformers_names_it(second), "README.md", "exec"), ns)
    prompt = ns["inputs"]["input_ids"].shape[1]
    assert ns["out"].shape[1] <= prompt + 256
    assert int(ns["cache"].get_seq_length()) == ns["out"].shape[1] - 1  # the last token is never fed back
