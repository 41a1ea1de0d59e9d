"""kvsqueeze.heap: the allocator's bytes in use follow what is allocated and freed (glibc only)."""

import pytest
import torch

from kvsqueeze.heap import heap_in_use, release_freed_memory


def test_heap_in_use_follows_an_allocation_and_its_release():
    before = heap_in_use()
    if before is None:
        pytest.skip("not glibc 2.33+: no mallinfo2")
    x = torch.ones(16 << 20)  # 64 MiB, touched
    held = heap_in_use()
    del x
    release_freed_memory()
    after = heap_in_use()
    assert held - before >= 64 << 20
    assert after - before < 8 << 20
