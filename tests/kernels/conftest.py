"""Kernel tests: without a GPU, Triton kernels run under its CPU interpreter.

The switch must be set before Triton is first imported (``@triton.jit`` and Triton's settings read it then),
hence here at collection time rather than in a fixture.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
