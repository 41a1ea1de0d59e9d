"""Packed K/V pages for vLLM's paged pool: the formats match kvsqueeze's presets, writes in any chunking give the
same pool, and attention over packed pages matches kernels/reference.py over the same decoded K/V."""

from __future__ import annotations

import pytest
import torch

from kvsqueeze.kernels import paged
from kvsqueeze.kernels.paged import FORMATS, PagedStore, paged_attention, paged_format, pool_bits_per_element
from kvsqueeze.kernels.reference import attend_segments
from kvsqueeze.quant.integer import fake_quantize
from kvsqueeze.spec import PRESETS

N, H, D = 32, 2, 64


def _kv(p, seed=0, h=H, d=D):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(p, h, N, d, generator=g) * torch.linspace(0.2, 3, d)  # uneven channels, as real keys
    return k, torch.randn(p, h, N, d, generator=g)


@pytest.mark.parametrize("name,preset", [("kivi-4", "kivi-4"), ("kivi-2", "kivi-2"), ("int8", "int8"),
                                         ("kivi-4-sink4", "kivi-4"), ("kivi-2-sink4", "kivi-2-sink4")])
def test_pages_decode_to_what_the_preset_stores(name, preset):
    """A page of 32 tokens is one KIVI key group: decoding equals the preset's own quantize-dequantize."""
    fmt = paged_format(name)
    k, v = _kv(3)
    pages = fmt.encode(k, v)
    assert pages.dtype == torch.uint8 and pages.shape == (3, H, fmt.page_bytes(N, D))
    dk, dv = fmt.decode(pages, N, D)
    spec = PRESETS[preset]
    assert torch.equal(dk, fake_quantize(k, spec.key))
    assert torch.equal(dv, fake_quantize(v, spec.value))


def test_bits_per_element():
    assert paged_format("kivi-4").bits_per_element(N, D) == 5.0  # 4 + fp16 scale+zero per 32 (tokens, channels)
    assert paged_format("kivi-2").bits_per_element(N, D) == 3.0
    assert paged_format("int8").bits_per_element(N, D) == 8.5
    assert pool_bits_per_element(paged_format("kivi-4"), N, D) == 5.0
    assert paged_format("kivi-2-sink4").bits_per_element(N, D) == 3.0  # in the pool; sinks are counted by kv_bytes
    with pytest.raises(ValueError, match="allowed: kivi-4, kivi-2, int8, kivi-4-sink4, kivi-2-sink4"):
        paged_format("kivi-3")


def _fill(store, pool, k, v, blocks, chunks):
    """Write one sequence's tokens k, v [T, H, D] into ``blocks`` in the given chunk lengths."""
    t = 0
    for c in chunks:
        slots = torch.tensor([blocks[i // N] * N + i % N for i in range(t, t + c)])
        store.write(pool, k[t:t + c], v[t:t + c], slots)
        t += c


@pytest.mark.parametrize("name", list(FORMATS))
def test_chunked_writes_give_the_same_pool(name):
    fmt = paged_format(name)
    T = 3 * N + 7
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g)
    pools = []
    for chunks in ([T], [5, 40, 1, 1, T - 47], [1] * T):
        pool = torch.zeros(6, H, fmt.token_bytes(N, D) * N, dtype=torch.uint8)
        store = PagedStore(fmt, N, H, D)
        _fill(store, pool, k, v, [4, 1, 3, 0], chunks)
        store.flush(pool, torch.tensor([[4, 1, 3, 0]]), torch.tensor([T]))  # sink formats pack here
        assert set(store.partial) == {0}  # the last page (7 tokens) stays in full precision
        assert torch.equal(store.partial[0][0, :, :7], k[3 * N:].transpose(0, 1))
        pools.append(pool)
    assert all(torch.equal(p, pools[0]) for p in pools[1:])
    k3, v3 = k[:3 * N].reshape(3, N, H, D).transpose(1, 2).clone(), v[:3 * N].reshape(3, N, H, D).transpose(1, 2).clone()
    if fmt.sinks:  # the first page without its sinks (each replaced by the token after them)
        k3[0, :, : fmt.sinks], v3[0, :, : fmt.sinks] = k3[0, :, fmt.sinks:fmt.sinks + 1], v3[0, :, fmt.sinks:fmt.sinks + 1]
    expect = fmt.encode(k3, v3)
    assert torch.equal(pools[0][[4, 1, 3], :, : expect.shape[-1]], expect)


def test_padding_slots_are_skipped_and_a_restarted_block_drops_its_stale_tokens():
    fmt = paged_format("kivi-4")
    pool = torch.zeros(2, H, fmt.token_bytes(N, D) * N, dtype=torch.uint8)
    store = PagedStore(fmt, N, H, D)
    x = torch.randn(3, H, D)
    store.write(pool, x, x, torch.tensor([0, 1, -1]))
    store.write(pool, x[:1], x[:1], torch.tensor([0]))  # block 0 reused from offset 0
    assert torch.equal(store.partial[0][0, :, 1], torch.zeros(H, D))
    with pytest.raises(RuntimeError, match="before its offset 0"):
        store.write(pool, x[:1], x[:1], torch.tensor([N + 5]))


def _reference(q, segments_k, segments_v, length, scale):
    """kernels/reference.py over the decoded pages of one sequence: its queries are the last tokens."""
    ql = q.shape[0]
    kv_len = sum(k.shape[1] for k in segments_k)
    pos_q = torch.arange(length - ql, length)
    mask = (torch.arange(kv_len)[None, :] <= pos_q[:, None])[None, None]
    segs, start = [], 0
    for k, v in zip(segments_k, segments_v):
        segs.append((start, k[None], v[None], False))
        start += k.shape[1]
    return attend_segments(q.transpose(0, 1)[None], segs, mask, scale)[0].transpose(0, 1)


def _paged_case(name, hq, dtype, kernel):
    """Prefill chunks and decode steps of three sequences of different lengths (one ends on a page boundary),
    attention read from the packed pages and the partial pages, against the reference over the same K/V."""
    fmt = paged_format(name)
    torch.manual_seed(0)
    lens = [2 * N + 5, N, 3 * N + 17]
    blocks = [[7, 2, 9], [4], [0, 8, 3, 5]]
    pool = torch.zeros(10, H, fmt.token_bytes(N, D) * N, dtype=torch.uint8)
    store = PagedStore(fmt, N, H, D)
    ks = [torch.randn(t, H, D).to(dtype) for t in lens]  # the model's dtype: the partial pages keep it
    vs = [torch.randn(t, H, D).to(dtype) for t in lens]
    table = torch.zeros(3, 4, dtype=torch.int32)
    for s, b in enumerate(blocks):
        table[s, : len(b)] = torch.tensor(b)
    scale = D ** -0.5
    # step 1: each sequence's tokens but its last q_len are written; step 2 writes those and attends with them
    qlens = [1, 20, 40]  # a decode step, and chunked-prefill continuations crossing pages
    for s in range(3):
        _fill(store, pool, ks[s], vs[s], blocks[s], [lens[s] - qlens[s]])
    for s in range(3):
        t0 = lens[s] - qlens[s]
        slots = torch.tensor([blocks[s][i // N] * N + i % N for i in range(t0, lens[s])])
        store.write(pool, ks[s][t0:], vs[s][t0:], slots)
    q = torch.randn(sum(qlens), hq, D).to(dtype)
    qsl = torch.tensor([0, 1, 21, 61])
    got = paged_attention(q, store, pool, table, torch.tensor(lens), qsl, scale, pages_per_step=2, kernel=kernel)
    assert got.dtype == dtype
    # the reference's own float32 rounding; the C++ kernel scores integer keys with a query rounded to ~15 bits
    # (kernels/cpu.py integer_scores); half-precision outputs are rounded once at the end
    tol = {torch.float32: 2e-5 if not kernel else 4e-4, torch.bfloat16: 1e-2}[dtype]
    for s in range(3):
        n_full, tail = divmod(lens[s], N)
        seg_k, seg_v = [], []
        if n_full:
            dk, dv = fmt.decode(pool[blocks[s][:n_full]], N, D)
            if fmt.sinks:  # a sequence's first tokens are read exactly, from beside the pool
                dk[0, :, : fmt.sinks] = ks[s][: fmt.sinks].transpose(0, 1).float()
                dv[0, :, : fmt.sinks] = vs[s][: fmt.sinks].transpose(0, 1).float()
            seg_k.append(dk.transpose(0, 1).reshape(H, -1, D))
            seg_v.append(dv.transpose(0, 1).reshape(H, -1, D))
        if tail:  # the last, partial page is exact
            seg_k.append(ks[s][n_full * N:].transpose(0, 1).float())
            seg_v.append(vs[s][n_full * N:].transpose(0, 1).float())
        ref = _reference(q[qsl[s]:qsl[s + 1]].float(), seg_k, seg_v, lens[s], scale)
        torch.testing.assert_close(got[qsl[s]:qsl[s + 1]].float(), ref, atol=tol, rtol=tol)
        # and the quantization is real: packed pages differ from the exact K/V
        if n_full:
            assert not torch.equal(seg_k[0], ks[s][: n_full * N].float().reshape(n_full, N, H, D)
                                   .permute(2, 0, 1, 3).reshape(H, -1, D))


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("hq", [2, 6])  # MHA and GQA (3 query heads per KV head)
def test_paged_attention_reference_matches_kernels_reference(name, hq):
    _paged_case(name, hq, torch.float32, kernel=False)


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("hq", [2, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_cpu_kernel_matches_the_reference(cpu_isa, name, hq, dtype, monkeypatch):
    """The C++ kernel reads the pages in place (decode for 1 query, its multi-query entry for 20 and 40)."""
    def no_fallback(*_):
        raise AssertionError("the torch reference ran where the C++ kernel should have")

    monkeypatch.setattr(paged, "_reference_sequence", no_fallback)
    _paged_case(name, hq, dtype, kernel=True)


@pytest.mark.parametrize("name", ["kivi-4", "int8", "kivi-2-sink4"])
def test_many_sequences_split_over_threads_give_the_serial_result(cpu_isa, name):
    """With at least two sequences per thread, the kernel's call takes whole sequences per thread (_csrc/paged.h):
    the same outputs as one sequence after another, and the reference's within its integer-key bound; decode steps
    and multi-query chunks (20 and 40 queries: the multi-query entry, its GEMMs on a worker thread) mixed."""
    fmt = paged_format(name)
    g = torch.Generator().manual_seed(5)
    lens = [3 * N + 5, N, 2 * N, 5 * N + 31, 7, 4 * N + 1]
    blocks, nxt = [], 0
    for t in lens:
        blocks.append(list(range(nxt, nxt + t // N + 1)))
        nxt += t // N + 1
    pool = torch.zeros(nxt, H, fmt.token_bytes(N, D) * N, dtype=torch.uint8)
    store = PagedStore(fmt, N, H, D)
    table = torch.zeros(len(lens), max(len(b) for b in blocks), dtype=torch.int32)
    for s, (t, b) in enumerate(zip(lens, blocks)):
        table[s, : len(b)] = torch.tensor(b)
        _fill(store, pool, torch.randn(t, H, D, generator=g), torch.randn(t, H, D, generator=g), b, [t])
    qlens = [1, 20, 1, 40, 1, 3]  # each sequence's last tokens are the step's queries
    q = torch.randn(sum(qlens), 6, D, generator=g)
    starts = torch.tensor([0] + qlens).cumsum(0)
    args = (q, store, pool, table, torch.tensor(lens), starts, D ** -0.5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # 6 sequences >= 2 per thread: the split over sequences
        split = paged_attention(*args)
        with torch.inference_mode():  # as vLLM calls it: the output is an inference tensor the threads write
            inference = paged_attention(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
        torch.set_num_threads(1)
        serial = paged_attention(*args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(split, serial) and torch.equal(inference, serial)
    ref = paged_attention(*args, kernel=False)
    assert (split - ref).abs().max() <= 4e-4


def test_sink_tokens_stay_exact_and_out_of_their_page_ranges():
    """A sequence's first page, packed at the step's flush, keeps its 4 sink tokens exactly beside the pool and
    quantizes the rest of the page without them: an outlier sink widens no channel's range."""
    fmt, plain = paged_format("kivi-2-sink4"), paged_format("kivi-2")
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(N + 3, H, D, generator=g), torch.randn(N + 3, H, D, generator=g)
    k[0] *= 50  # the sink's outlier channels
    errors = {}
    for f in (fmt, plain):
        pool = torch.zeros(4, H, f.token_bytes(N, D) * N, dtype=torch.uint8)
        store = PagedStore(f, N, H, D)
        _fill(store, pool, k, v, [2, 0], [N + 3])
        table, lens = torch.tensor([[2, 0]]), torch.tensor([N + 3])
        assert (2 in store.pending) == bool(f.sinks)  # sink formats pack at the flush
        store.flush(pool, table, lens)
        assert not store.pending
        dk, _ = f.decode(pool[[2]], N, D)
        errors[f.name] = (dk[0, :, 4:] - k[4:N].transpose(0, 1)).abs().mean().item()
    assert torch.equal(store.sinks.get(2, torch.empty(0)), torch.empty(0))  # kivi-2 keeps none
    assert errors["kivi-2-sink4"] < errors["kivi-2"] / 5


def test_a_reused_block_drops_its_sinks():
    fmt = paged_format("kivi-4-sink4")
    pool = torch.zeros(2, H, fmt.token_bytes(N, D) * N, dtype=torch.uint8)
    store = PagedStore(fmt, N, H, D)
    x = torch.randn(N, H, D)
    _fill(store, pool, x, x, [1], [N])
    store.flush(pool, torch.tensor([[1]]), torch.tensor([N]))
    assert torch.equal(store.sinks[1][0], x[:4].transpose(0, 1))
    _fill(store, pool, x[:2], x[:2], [1], [2])  # block 1 given to another sequence, from offset 0
    assert 1 not in store.sinks


def test_sinks_that_fill_a_page_are_refused():
    with pytest.raises(ValueError, match="32 sink tokens do not fit a page of 32"):
        PagedStore(paged.PagedFormat("bad", 4, 4, key_group=0, value_group=32, sinks=32), N, H, D)


def test_a_block_outside_the_pool_is_refused(cpu_isa):
    fmt = paged_format("kivi-4")
    pool = torch.zeros(2, H, fmt.token_bytes(N, D) * N, dtype=torch.uint8)
    store = PagedStore(fmt, N, H, D)
    with pytest.raises(RuntimeError, match="page block 5 is outside the pool of 2"):
        paged_attention(torch.randn(1, H, D), store, pool, torch.tensor([[5, 0]]), torch.tensor([N]),
                        torch.tensor([0, 1]), 0.125)


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_formats_benchmark_emulates_what_the_store_returns(name):
    """benchmarks/paged_formats.py's whole-sequence emulation (K/V of a chunk as the plugin's pages hold them)
    equals what a PagedStore writes and its pages plus sinks decode to."""
    import importlib.util

    from ._helpers import ROOT

    spec = importlib.util.spec_from_file_location("paged_formats", ROOT / "benchmarks" / "paged_formats.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    fmt = paged_format(name)
    T = 3 * N
    g = torch.Generator().manual_seed(3)
    k = torch.randn(T, H, D, generator=g) * torch.linspace(0.2, 3, D)
    v = torch.randn(T, H, D, generator=g)
    pool = torch.zeros(4, H, fmt.token_bytes(N, D) * N, dtype=torch.uint8)
    store = PagedStore(fmt, N, H, D)
    blocks = [2, 0, 3]
    _fill(store, pool, k, v, blocks, [T])
    store.flush(pool, torch.tensor([blocks]), torch.tensor([T]))
    dk, dv = fmt.decode(pool[blocks], N, D)  # [3, H, N, D]
    if fmt.sinks:
        dk[0, :, : fmt.sinks], dv[0, :, : fmt.sinks] = store.sinks[blocks[0]][0], store.sinks[blocks[0]][1]
    ek, ev = bench.paged_kv(fmt, k.transpose(0, 1)[None], v.transpose(0, 1)[None])  # [1, H, T, D]
    assert torch.equal(ek[0], dk.transpose(0, 1).reshape(H, T, D))
    assert torch.equal(ev[0], dv.transpose(0, 1).reshape(H, T, D))
