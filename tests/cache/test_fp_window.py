"""The full-precision window ring: one buffer reused across wraps, and checkpoints that survive a wrap."""

from __future__ import annotations

import torch

from kvsqueeze.cache.layer import FpWindow


def _tokens(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.float32).view(1, 1, n, 1)


def test_buffer_is_reused_across_many_wraps():
    """A window that keeps 8 live tokens in a 24-token buffer wraps every 16 steps; a new buffer at each wrap
    would touch fresh pages every step (RSS climbing in long runs), so the buffer must stay the same."""
    win = FpWindow(24)
    win.append(_tokens(0, 1), _tokens(0, 1))
    ptr = win.k.data_ptr()
    for step in range(1, 500):
        win.append(_tokens(step, 1), -_tokens(step, 1))
        if win.length > 8:
            win.drop_front(win.length - 8)
        k, v = win.view()
        assert torch.equal(k.flatten(), torch.arange(step - k.shape[2] + 1, step + 1, dtype=torch.float32))
        assert torch.equal(v.flatten()[1:], -k.flatten()[1:])
    assert win.k.data_ptr() == ptr


def test_checkpoint_survives_a_wrap_in_the_step():
    """A wrap right after a checkpoint must not overwrite the checkpoint's tokens: restoring gives them back."""
    win = FpWindow(12)
    win.append(_tokens(0, 10), _tokens(0, 10))
    win.drop_front(6)  # live: 6..9 at buffer positions 6..9
    state = win.checkpoint()
    win.append(_tokens(10, 4), _tokens(10, 4))  # does not fit after position 9: moves or reallocates
    assert torch.equal(win.view()[0].flatten(), torch.arange(6, 14, dtype=torch.float32))
    win.restore(state)
    assert torch.equal(win.view()[0].flatten(), torch.arange(6, 10, dtype=torch.float32))


def test_in_place_move_after_the_checkpoint_tokens_left_the_front():
    """Once the live tokens start past the checkpoint's end region the move is in place, and a rollback still
    finds the checkpoint's tokens untouched."""
    win = FpWindow(16)
    win.append(_tokens(0, 14), _tokens(0, 14))
    win.drop_front(12)  # live 12, 13 at positions 12, 13
    state = win.checkpoint()  # kept region (12, 2): the move writes only [0, 4)
    ptr = win.k.data_ptr()
    win.append(_tokens(14, 2), _tokens(14, 2))
    win.append(_tokens(16, 1), _tokens(16, 1))  # wraps: 5 tokens... fits in place below position 12
    assert win.k.data_ptr() == ptr
    assert torch.equal(win.view()[0].flatten(), torch.arange(12, 17, dtype=torch.float32))
    win.restore(state)
    assert torch.equal(win.view()[0].flatten(), torch.tensor([12.0, 13.0]))


def test_no_in_place_move_over_the_checkpoint_tokens():
    """Tokens dropped after the checkpoint still belong to it: a move that would write over them reallocates."""
    win = FpWindow(20)
    win.append(_tokens(0, 12), _tokens(0, 12))
    win.drop_front(10)  # live 10, 11
    state = win.checkpoint()
    win.drop_front(1)  # live 11 at position 11; the checkpoint still needs position 10
    win.append(_tokens(12, 10), _tokens(12, 10))  # 11 tokens would go to [0, 11): over position 10
    assert torch.equal(win.view()[0].flatten(), torch.arange(11, 22, dtype=torch.float32))
    win.restore(state)
    assert torch.equal(win.view()[0].flatten(), torch.tensor([10.0, 11.0]))
