"""Kernel tests: without a GPU, Triton kernels run under its CPU interpreter.

The switch must be set before Triton is first imported (``@triton.jit`` and Triton's settings read it then),
hence here at collection time rather than in a fixture.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvsqueeze.kernels import cpu

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(params=cpu.ISAS)
def cpu_isa(request):
    """Run a C++ kernel test on every instruction-set path this CPU can run (each its own build); the others skip."""
    isa = request.param
    if isa not in cpu.runnable_isas():
        pytest.skip(f"this CPU cannot run the C++ kernel's {isa} path")
    if request.node.get_closest_marker("default_isa") and isa != cpu.runnable_isas()[0]:
        pytest.skip("a model-level test: run on the default instruction-set path only")
    with cpu.use_isa(isa):
        if cpu.load_extension() is None:
            if cpu.load_extension(isa=cpu.runnable_isas()[0]) is not None:  # a compiler is here: a real failure
                pytest.fail(f"the C++ kernel's {isa} build failed: {cpu._failed.get(isa)}")
            pytest.skip(f"C++ kernel ({isa}) could not be built here")
        yield isa
