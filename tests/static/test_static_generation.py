"""Helpers of the greedy loop: the first-divergence report."""

from __future__ import annotations

import numpy as np
import pytest

from kvsqueeze.engines.static_generation import first_divergence


def test_first_divergence_tells_a_tie_from_an_error_spike():
    ref = [np.array([[0.0, 1.0, 0.0]]), np.array([[1.0, 0.9, 0.0]])]
    small = [np.array([[0.05, 1.0, 0.0]]), np.array([[1.0, 1.05, 0.0]])]  # error 0.05 before, margin 0.1
    div = first_divergence([1, 0], [1, 1], ref, small)
    assert div["index"] == 1 and div["tie_within_error"] and div["max_err"] == pytest.approx(0.05)
    spike = [np.array([[0.01, 1.0, 0.0]]), np.array([[0.0, 2.0, 0.0]])]  # error 0.01 before, then a jump
    assert not first_divergence([1, 0], [1, 1], ref, spike)["tie_within_error"]
    assert first_divergence([1, 2], [1, 2]) is None
