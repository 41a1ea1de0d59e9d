"""Cache blocks carved from huge-page slabs (cache/arena.py), and the stores' reuse of dropped blocks."""

from __future__ import annotations

import os

import torch

from kvsqueeze import QuantizedCache
from kvsqueeze.adapter import cache_kwargs
from kvsqueeze.cache import arena as arena_mod
from kvsqueeze.cache.arena import BlockArena
from kvsqueeze.cache.blocks import SPARE_BLOCKS, BlockStore
from kvsqueeze.cache.factory import make_codec
from kvsqueeze.heap import HUGE_PAGE, huge_page_buffer
from kvsqueeze.spec import QuantSpec

KEY = QuantSpec(bits=2, axis="channel", group=8)
VALUE = QuantSpec(bits=4, axis="token", group=32)


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def test_parts_are_aligned_disjoint_views_of_doubling_slabs():
    arena = BlockArena()
    shapes = [((1, 2, 256, 32), torch.uint8), ((1, 2, 8, 64), torch.float16), ((1, 2, 256, 4), torch.float32)] * 300
    parts = [arena.empty(s, d) for s, d in shapes]
    for t, (s, d) in zip(parts, shapes):
        assert t.shape == s and t.dtype == d and t.is_contiguous() and t.data_ptr() % 64 == 0
    spans = sorted(_span(t) for t in parts)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two parts overlap
    slabs = {t.untyped_storage().data_ptr() for t in parts}
    assert 1 < len(slabs) < len(parts) // 100  # many parts per slab
    assert arena.slab_bytes == arena_mod.FIRST_SLAB * 2 ** (len(slabs) - 1) <= arena_mod.LAST_SLAB
    for i, t in enumerate(parts):
        t.fill_(i % 100)
    assert all(t.eq(i % 100).all() for i, t in enumerate(parts))  # writes stay inside their part


def test_large_and_empty_parts():
    arena = BlockArena()
    big = arena.empty((4, 8, 256, 128), torch.float32)  # 4 MiB: a slab of its own
    assert big.shape == (4, 8, 256, 128) and arena._slab is None
    big.fill_(1.5)
    assert big.sum().item() == 1.5 * big.numel()
    assert arena.empty((1, 2, 0, 16), torch.uint8).numel() == 0


def test_huge_page_buffers_are_aligned_and_live_outside_the_malloc_heap():
    """Advised memory inside malloc's brk heap passed the advice on to the heap's later growth (the kernel extends
    the heap's last mapping), so every slab is a mapping of its own."""
    buf, advised = huge_page_buffer(3 * HUGE_PAGE + 4096)
    assert buf.numel() == 3 * HUGE_PAGE + 4096 and buf.data_ptr() % HUGE_PAGE == 0
    assert advised in (0, 3 * HUGE_PAGE)
    if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):  # Linux with THP compiled in
        assert advised == 3 * HUGE_PAGE
    buf[-1] = 7
    assert buf[-1].item() == 7 and buf[0].item() == 0
    if os.path.exists("/proc/self/maps"):
        p = buf.data_ptr()
        for line in open("/proc/self/maps"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= p < hi:
                assert "[heap]" not in line
                break


def _store(arena=True, block=32):
    store = BlockStore(make_codec(KEY, 64, torch.float32), make_codec(VALUE, 64, torch.float32), 1, 2, block,
                       torch.device("cpu"))
    store.arena = BlockArena() if arena else None
    return store


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, n, 64, generator=g), torch.randn(1, 2, n, 64, generator=g)


def _decoded(store):
    ks, vs = zip(*[(k, v) for _, k, v in store.chunks()])
    return torch.cat(ks, dim=2), torch.cat(vs, dim=2)


def test_stores_equal_with_and_without_an_arena():
    a, b = _store(True), _store(False)
    for seed, n in enumerate((40, 8, 64, 24)):
        k, v = _tokens(n, seed)
        a.append(k, v)
        b.append(k, v)
    for x, y in zip(_decoded(a), _decoded(b)):
        assert torch.equal(x, y)
    blk = a.blocks[0].parts
    assert len({t.untyped_storage().data_ptr() for t in blk.values()}) == 1  # one slab holds the block's parts


def test_sliding_window_reuses_evicted_blocks():
    """A store that evicts as it appends keeps its memory: evicted blocks come back as new ones."""
    store = _store()
    seen = set()
    for i in range(40):
        store.append(*_tokens(16, i))
        store.evict_before(store.end - 48)
        seen |= {blk.parts["k.codes"].data_ptr() for blk in store.blocks}
    assert len(store.blocks) <= 3 and len(store._spare) <= SPARE_BLOCKS
    assert len(seen) <= 3 + SPARE_BLOCKS  # 20 blocks' worth of tokens went through 5 blocks' memory
    assert store.arena.slab_bytes == arena_mod.FIRST_SLAB  # one slab


def test_crop_then_append_reuses_the_dropped_block_and_reads_the_new_tokens():
    store = _store()
    k1, v1 = _tokens(80, 1)
    store.append(k1, v1)  # blocks [0, 32) [32, 64) [64, 96)
    dropped = store.blocks[-1].parts["k.codes"].data_ptr()
    store.truncate(64)
    k2, v2 = _tokens(40, 2)
    store.append(k2, v2)
    assert store.blocks[2].parts["k.codes"].data_ptr() == dropped
    ref = _store(arena=False)
    ref.append(k1[:, :, :64], v1[:, :, :64])
    ref.append(k2, v2)
    for x, y in zip(_decoded(store), _decoded(ref)):
        assert torch.equal(x, y)


def test_restore_takes_an_evicted_block_back_from_the_spares():
    """Evicted in a step that is then rolled back, a block is stored again: it must not be handed out as new."""
    store = _store()
    k, v = _tokens(64, 3)
    store.append(k, v)
    state = store.checkpoint()
    store.append(*_tokens(32, 4))
    store.evict_before(32)  # block [0, 32) becomes a spare
    store.restore(state)
    assert store._spare == [] and len(store.blocks) == 2
    store.append(*_tokens(40, 5))  # needs a new block: must not reuse [0, 32)
    assert torch.equal(_decoded(store)[0][:, :, :64], _decoded(_filled(k, v))[0])


def _filled(k, v):
    ref = _store(arena=False)
    ref.append(k, v)
    return ref


def test_cache_layers_share_one_arena(tiny_llama):
    cache = QuantizedCache(tiny_llama.config, "kivi-2")
    ids = torch.randint(2, 256, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tiny_llama(ids, **cache_kwargs(tiny_llama, cache))
    stores = [layer.kv.store for layer in cache.layers]
    assert stores[0].arena is stores[1].arena is not None
    slabs = {t.untyped_storage().data_ptr() for s in stores for blk in s.blocks for t in blk.parts.values()}
    assert len(slabs) == 1
