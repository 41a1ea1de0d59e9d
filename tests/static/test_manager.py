"""StaticKVManager invariants, copy counts and the seed's memory formula."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsqueeze.engines.static_manager import (
    StaticKVManager,
    WindowFullError,
    expected_copies,
    reserved_tokens,
    static_buffer_bytes,
)

L, H, D = 2, 2, 3


def _tokens(start: int, n: int, batch: int, layout: str, sign: float = 1.0) -> np.ndarray:
    """Token ``t`` of row ``b`` holds value ``sign * (1000 * b + t + 1)`` everywhere, so a window is readable."""
    t = np.arange(start, start + n, dtype=np.float32)[None, :] + 1 + 1000 * np.arange(batch)[:, None]
    x = np.broadcast_to((sign * t)[:, None, :, None], (batch, H, n, D))  # [B, H, n, D]
    return np.ascontiguousarray(x.transpose(2, 0, 1, 3) if layout == "token" else x)


def _window_ids(m: StaticKVManager, layer: int) -> np.ndarray:
    k, v = m.window(layer)
    if m.layout == "token":
        k, v = k.transpose(1, 2, 0, 3), v.transpose(1, 2, 0, 3)
    assert np.array_equal(k, -v) or not k.any()  # K and V moved together
    return k[:, 0, :, 0]  # [B, S-1] token values


def _expected_window(total: int, window: int, batch: int) -> np.ndarray:
    """The last ``window`` tokens, left-padded with zeros."""
    out = np.zeros((batch, window), np.float32)
    n = min(total, window)
    if n:
        out[:, window - n:] = np.arange(total - n, total)[None, :] + 1 + 1000 * np.arange(batch)[:, None]
    return out


@settings(max_examples=60, deadline=None)
@given(
    max_len=st.integers(2, 12),
    reserve=st.sampled_from([1.5, 2.0, 3.0]),
    batch=st.integers(1, 3),
    layout=st.sampled_from(["token", "head"]),
    chunks=st.lists(st.integers(1, 6), min_size=1, max_size=40),
)
def test_window_is_last_tokens_left_padded(max_len, reserve, batch, layout, chunks):
    w = max_len - 1
    r = reserved_tokens(max_len, reserve)
    m = StaticKVManager(L, H, D, max_len, batch_size=batch, reserved=r, layout=layout, on_full="slide")
    total = 0
    for n in chunks:
        n = min(n, r - w)
        m.append([_tokens(total, n, batch, layout)] * L, [_tokens(total, n, batch, layout, -1.0)] * L)
        total += n
        for layer in range(L):
            assert np.array_equal(_window_ids(m, layer), _expected_window(total, w, batch))
        valid = min(total, w)
        mask = m.attention_mask()
        assert mask.shape == (batch, max_len)
        assert (mask[:, : w - valid] == 0).all() and (mask[:, w - valid:] == 1).all()
        assert (m.position_ids() == total).all()
        assert m.start + w <= r
    # every copy moves the S-1 token window of each layer's K and V, nothing else
    assert m.stats.bytes_moved == m.stats.copies * 2 * L * w * m.token_bytes
    assert m.stats.buffer_copies == 2 * L * m.stats.copies
    assert m.stats.requantizations == 0
    # a copy happens only after R - (S-1) - (largest chunk) + 1 tokens since the previous one
    assert m.stats.copies <= total // max(1, r - w - max(chunks) + 1)


@settings(max_examples=40, deadline=None)
@given(max_len=st.integers(2, 40), reserve=st.sampled_from([1.5, 2.0]), steps=st.integers(0, 200),
       prompt=st.integers(1, 39))
def test_copy_count_matches_formula(max_len, reserve, steps, prompt):
    w = max_len - 1
    prompt = min(prompt, w)
    m = StaticKVManager(1, 1, 2, max_len, reserve=reserve, on_full="slide")
    m.load_prefill([np.zeros((w, 1, 1, 2), np.float32)], [np.zeros((w, 1, 1, 2), np.float32)], [prompt])
    one = np.zeros((1, 1, 1, 2), np.float32)
    for _ in range(steps):
        m.append([one], [one])
    assert m.stats.copies == expected_copies(steps, max_len, m.reserved)
    if m.reserved >= 2 * w:  # reserve 2(S-1): at most one copy per S-1 generated tokens
        assert m.stats.copies <= steps // w


def test_copies_per_1000_tokens_reserve_2_vs_15_vs_naive():
    s, w = 256, 255
    counts = {}
    for name, kw in (("2", dict(reserve=2.0)), ("1.5", dict(reserve=1.5)), ("naive", dict(reserved=s))):
        m = StaticKVManager(1, 1, 4, s, on_full="slide", **kw)
        one = np.zeros((1, 1, 1, 4), np.float32)
        for _ in range(1000):
            m.append([one], [one])
        counts[name] = m.stats.copies
    assert counts == {"2": 999 // w, "1.5": 999 // (383 - w), "naive": 999}


def test_seed_memory_figures():
    # Llama-7B: 32 blocks, 32 heads, D = 128, S = 2048, 16-bit
    assert static_buffer_bytes(32, 32, 128, 2048, reserve=2, bits=16) == 2_146_435_072
    assert static_buffer_bytes(32, 32, 128, 2048, reserve=1.5, bits=16) == 1_609_826_304
    assert static_buffer_bytes(32, 32, 128, 2048, reserve=2, bits=8) == 2_146_435_072 // 2


@pytest.mark.parametrize("reserve,bits,dtype", [(2.0, 32, np.float32), (1.5, 8, np.uint8), (2.0, 8, np.int8)])
def test_manager_allocates_the_formula(reserve, bits, dtype):
    # S - 1 = 254 is even, so 1.5(S-1) is a whole number of tokens and the allocation equals the formula
    m = StaticKVManager(30, 3, 64, 255, reserve=reserve, dtype=dtype, batch_size=2)
    assert m.nbytes == static_buffer_bytes(30, 3, 64, 255, reserve=reserve, bits=bits, batch_size=2)


def test_stop_when_full_leaves_buffers_untouched():
    m = StaticKVManager(L, H, D, 5, on_full="stop")
    for t in range(4):
        m.append([_tokens(t, 1, 1, "token")] * L, [_tokens(t, 1, 1, "token", -1.0)] * L)
    before = [b.copy() for b in (*m.k, *m.v)], m.start, m.lengths.copy(), m.stats.as_dict()
    with pytest.raises(WindowFullError, match="on_full='slide'"):
        m.append([_tokens(4, 1, 1, "token")] * L, [_tokens(4, 1, 1, "token", -1.0)] * L)
    assert all(np.array_equal(a, b) for a, b in zip(before[0], (*m.k, *m.v)))
    assert (m.start, m.lengths.tolist(), m.stats.as_dict()) == (before[1], before[2].tolist(), before[3])


def test_bad_input():
    with pytest.raises(ValueError, match="reserve"):
        StaticKVManager(1, 1, 4, 8, reserve=1.0)
    with pytest.raises(ValueError, match="layout"):
        StaticKVManager(1, 1, 4, 8, layout="bhsd")
    with pytest.raises(ValueError, match="max_len"):
        StaticKVManager(1, 1, 4, 1)
    with pytest.raises(ValueError, match="bits"):
        static_buffer_bytes(32, 32, 128, 2048, bits=12)
    m = StaticKVManager(2, 1, 4, 8)
    with pytest.raises(ValueError, match="shape"):
        m.append([np.zeros((1, 1, 1, 5), np.float32)] * 2, [np.zeros((1, 1, 1, 5), np.float32)] * 2)
    with pytest.raises(ValueError, match="at most"):
        m.append([np.zeros((8, 1, 1, 4), np.float32)] * 2, [np.zeros((8, 1, 1, 4), np.float32)] * 2)
    with pytest.raises(ValueError, match="1..7"):
        m.commit_prefill([8])
    assert m.stats.tokens_appended == 0 and m.start == 0


def test_naive_manager_shifts_every_token():
    m = StaticKVManager.naive(1, 1, 2, 9, on_full="slide")
    one = np.zeros((1, 1, 1, 2), np.float32)
    for _ in range(20):
        m.append([one], [one])
    assert m.reserved == 9 and m.stats.copies == 19
    assert m.stats.bytes_moved == 19 * 2 * 8 * m.token_bytes


def test_head_layout_window_contiguity():
    assert StaticKVManager(1, 1, 4, 8, layout="head").contiguous  # B * H == 1: the seed's [1, 1, S-1, D] inputs
    assert not StaticKVManager(1, 2, 4, 8, layout="head").contiguous
    m = StaticKVManager(1, 2, 4, 8, layout="token", batch_size=3)
    assert m.contiguous and m.window(0)[0].flags.c_contiguous and m.window(0)[0].base is m.k[0]


def test_onnx_runtime_path_imports_no_torch():
    """The manager quantizes through torch (kvsqueeze.quant) only when asked: an ONNX Runtime deployment that
    imports the manager, the runner and the greedy loop does not load torch."""
    import subprocess
    import sys

    code = ("import sys, numpy as np\n"
            "import kvsqueeze.engines.onnx_runner, kvsqueeze.engines.static_generation\n"
            "from kvsqueeze.engines.static_manager import StaticKVManager, StaticKVQuant\n"
            "m = StaticKVManager(1, 1, 4, 8); m.append([np.ones((1, 1, 1, 4), np.float32)], "
            "[np.ones((1, 1, 1, 4), np.float32)])\n"
            "q = StaticKVQuant(8, False, 'tensor', *([np.ones((1, 1, 1), np.float32)] * 4))\n"
            "print(sorted(k for k in sys.modules if k == 'torch' or k.startswith('kvsqueeze.quant')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
