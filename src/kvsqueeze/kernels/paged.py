"""kvsqueeze formats inside a paged KV pool (vLLM's KV blocks), and attention read from the packed pages.

A page holds ``n`` tokens of every KV head.  Per KV head, its bytes are laid out as::

    [key codes | value codes | key scale | key zero | value scale | value zero]   (fp16 parameters)

* ``kivi-4`` / ``kivi-2``: keys per channel over the page's tokens (one scale and zero per channel per page: the
  KIVI grouping, with the page as the token group), values per token in groups of 32 channels;
* ``int8``: keys and values per token in groups of 64 channels;
* ``kivi-4-sink4`` / ``kivi-2-sink4``: as kivi-4 / kivi-2, and a sequence's first 4 tokens (attention sinks) also
  kept in full precision beside the pool, its first page packed without them.

Integer codes and parameters follow :func:`kvsqueeze.quant.integer.quantize_groups` (min-max, offset rounded
down and scale rounded up in fp16), so a packed page decodes to what kvsqueeze's own cache would store.

A page is packed when its last token is written; until then (a sequence's last, partial page) its tokens are
kept in full precision by :class:`PagedStore`, outside the pool.  :func:`paged_attention` reads a sequence's
pages in place with kvsqueeze's C++ kernel (:func:`kvsqueeze.kernels.cpu.attend_paged`), or, where it is not
built, decodes them a few at a time in torch (the reference it is tested against); the partial page and sinks
come from the store: no full-precision copy of a sequence's history is built.  Nothing here imports transformers:
it runs inside vLLM's processes, whose transformers is older than kvsqueeze's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from ..quant.integer import dequantize_groups, group_view, quantize_groups, ungroup_view
from ..quant.packing import pack_bits, packed_nbytes, unpack_bits

PARAM_BYTES = 2  # fp16 scales and zeros


@dataclass(frozen=True)
class PagedFormat:
    """Integer K/V codes of one page; ``key_group`` 0 means keys are grouped per channel over the page."""

    name: str
    key_bits: int
    value_bits: int
    key_group: int  # channels per key group (per-token keys), or 0: per channel over the page's tokens
    value_group: int  # channels per value group (values are per token)
    sinks: int = 0  # a sequence's first tokens also kept in full precision, outside the pool and its statistics

    def _parts(self, n: int, d: int) -> list[tuple[str, int]]:
        """(name, bytes) of one KV head's page, in order."""
        k_params = d if self.key_group == 0 else n * (d // self.key_group)
        v_params = n * (d // self.value_group)
        return [("key_codes", n * packed_nbytes(d, self.key_bits)),
                ("value_codes", n * packed_nbytes(d, self.value_bits)),
                ("key_scale", k_params * PARAM_BYTES), ("key_zero", k_params * PARAM_BYTES),
                ("value_scale", v_params * PARAM_BYTES), ("value_zero", v_params * PARAM_BYTES)]

    def check(self, n: int, d: int) -> None:
        if not 0 <= self.sinks < n:
            raise ValueError(f"{self.name}: {self.sinks} sink tokens do not fit a page of {n}")
        for g in (self.key_group, self.value_group):
            if g and d % g:
                raise ValueError(f"{self.name}: head_dim {d} is not a multiple of its {g}-channel groups")
        packed_nbytes(d, self.key_bits), packed_nbytes(d, self.value_bits)  # raises on a width that cannot pack

    def page_bytes(self, n: int, d: int) -> int:
        """Bytes of one KV head's page of ``n`` tokens."""
        return sum(b for _, b in self._parts(n, d))

    def token_bytes(self, n: int, d: int) -> int:
        """Bytes per (KV head, token) cell: the page's bytes over its tokens, rounded up."""
        return -(-self.page_bytes(n, d) // n)

    def bits_per_element(self, n: int, d: int) -> float:
        return 8 * self.page_bytes(n, d) / (n * 2 * d)

    def kernel_layout(self, n: int, d: int) -> list[int]:
        """Where the C++ kernel finds a head's page parts (``read_pages``): byte offsets of key codes, scale, zero,
        value codes, scale, zero, then the bytes of one row of each (a token; the page for per-channel keys)."""
        at, offsets = 0, {}
        for name, b in self._parts(n, d):
            offsets[name] = at
            at += b
        k_row = PARAM_BYTES * (d if self.key_group == 0 else d // self.key_group)
        v_row = PARAM_BYTES * (d // self.value_group)
        order = [f"{side}_{part}" for side in ("key", "value") for part in ("codes", "scale", "zero")]
        return [offsets[name] for name in order] + [packed_nbytes(d, self.key_bits), k_row, k_row,
                                                     packed_nbytes(d, self.value_bits), v_row, v_row]

    def kernel_format(self, n: int) -> list[int]:
        """The 12 ints (keys, then values) of a page's format for the C++ kernel."""
        from .cpu import int_codes_format

        return (int_codes_format(self.key_bits, self.key_group or n, self.key_group == 0)
                + int_codes_format(self.value_bits, self.value_group, False))

    def _split(self, flat: Tensor, n: int, d: int) -> dict[str, Tensor]:
        out, at = {}, 0
        for name, b in self._parts(n, d):
            out[name] = flat[..., at:at + b]
            at += b
        return out

    # -- one side (keys or values) of a batch of pages: x [P, H, n, d]
    def _side(self, side: str) -> tuple[int, int]:
        return (self.key_bits, self.key_group) if side == "key" else (self.value_bits, self.value_group)

    def _quantize(self, x: Tensor, side: str) -> tuple[Tensor, Tensor, Tensor]:
        bits, group = self._side(side)
        p, h, n, d = x.shape
        axis, g = ("channel", n) if group == 0 else ("token", group)
        codes, scale, zero = quantize_groups(group_view(x.float(), axis, g), bits)
        codes = ungroup_view(codes, axis, g, x.shape)
        return (pack_bits(codes.contiguous(), bits).reshape(p, h, -1),
                scale.reshape(p, h, -1).view(torch.uint8), zero.reshape(p, h, -1).view(torch.uint8))

    def _dequantize(self, codes: Tensor, scale: Tensor, zero: Tensor, n: int, d: int, side: str) -> Tensor:
        bits, group = self._side(side)
        p, h = codes.shape[:2]
        c = unpack_bits(codes.reshape(p, h, n, -1), bits, d)
        s, z = scale.contiguous().view(torch.float16), zero.contiguous().view(torch.float16)
        if group == 0:  # [P, H, 1, d, n] groups: one parameter per channel
            cg = group_view(c, "channel", n)
            x = dequantize_groups(cg, s.reshape(p, h, 1, d, 1), z.reshape(p, h, 1, d, 1), bits)
            return ungroup_view(x, "channel", n, (p, h, n, d))
        cg = group_view(c, "token", group)
        x = dequantize_groups(cg, s.reshape(p, h, n, d // group, 1), z.reshape(p, h, n, d // group, 1), bits)
        return ungroup_view(x, "token", group, (p, h, n, d))

    def encode(self, k: Tensor, v: Tensor) -> Tensor:
        """Full pages k, v [P, H, n, d] -> uint8 [P, H, page_bytes]."""
        p, h, n, d = k.shape
        kc, ks, kz = self._quantize(k, "key")
        vc, vs, vz = self._quantize(v, "value")
        return torch.cat([kc, vc, ks, kz, vs, vz], dim=-1)

    def decode(self, pages: Tensor, n: int, d: int) -> tuple[Tensor, Tensor]:
        """uint8 [P, H, >= page_bytes] -> float32 k, v [P, H, n, d]."""
        parts = self._split(pages, n, d)
        k = self._dequantize(parts["key_codes"], parts["key_scale"], parts["key_zero"], n, d, "key")
        v = self._dequantize(parts["value_codes"], parts["value_scale"], parts["value_zero"], n, d, "value")
        return k, v


FORMATS: dict[str, PagedFormat] = {
    "kivi-4": PagedFormat("kivi-4", 4, 4, key_group=0, value_group=32),
    "kivi-2": PagedFormat("kivi-2", 2, 2, key_group=0, value_group=32),
    "int8": PagedFormat("int8", 8, 8, key_group=64, value_group=64),
    "kivi-4-sink4": PagedFormat("kivi-4-sink4", 4, 4, key_group=0, value_group=32, sinks=4),
    "kivi-2-sink4": PagedFormat("kivi-2-sink4", 2, 2, key_group=0, value_group=32, sinks=4),
}


def paged_format(name: str) -> PagedFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown paged KV format {name!r}; allowed: {', '.join(FORMATS)}")
    return FORMATS[name]


class PagedStore:
    """Writes tokens into packed pages of a pool ``pages`` [num_blocks, H, >= page_bytes] (uint8): each page
    stays in full precision here until its last slot is written, then it is packed into the pool.

    Formats with sinks (attention-sink tokens: a sequence's first tokens draw much of every query's attention and
    carry outlier channels) keep a sequence's first ``fmt.sinks`` tokens in full precision beside its first page,
    and pack that page with those rows replaced by the next token, so the outliers widen no channel's range.
    Which page opens a sequence is known only from the step's block table, so sink formats pack a completed page
    at :meth:`flush` (the start of the step's attention) instead of at its write."""

    def __init__(self, fmt: PagedFormat, block_size: int, num_kv_heads: int, head_dim: int):
        fmt.check(block_size, head_dim)
        self.fmt, self.n, self.h, self.d = fmt, block_size, num_kv_heads, head_dim
        self.partial: dict[int, Tensor] = {}  # block id -> [2, H, n, d] (keys, values) in the model's dtype
        self.pending: dict[int, Tensor] = {}  # sink formats: complete pages not packed yet, as partial's
        self.sinks: dict[int, Tensor] = {}  # first block of a sequence -> [2, H, sinks, d], the model's dtype

    def write(self, pages: Tensor, key: Tensor, value: Tensor, slot_mapping: Tensor) -> None:
        """Store key/value [T, H, d] at ``slot_mapping`` [T] (block * n + offset; negative = padding).  A
        sequence's tokens arrive in order, so a page is complete when its offset n - 1 is written."""
        slots = slot_mapping[: key.shape[0]].tolist()
        n, full = self.n, []
        i = 0
        while i < len(slots):
            if slots[i] < 0:
                i += 1
                continue
            block, off = divmod(slots[i], n)
            j = i
            while j + 1 < len(slots) and slots[j + 1] == slots[j] + 1 and slots[j + 1] % n:
                j += 1  # a run of consecutive slots inside the same page
            if off == 0:  # the page starts (again): a stale buffer (and sinks) of a freed block are dropped
                buf = key.new_zeros((2, self.h, n, self.d))
                self.sinks.pop(block, None)
                self.pending.pop(block, None)
            else:
                buf = self.partial.get(block)
                if buf is None:
                    raise RuntimeError(f"paged KV: offset {off} of block {block} written before its offset 0")
            end = off + j - i + 1
            buf[0, :, off:end] = key[i:j + 1].transpose(0, 1)
            buf[1, :, off:end] = value[i:j + 1].transpose(0, 1)
            if end == n:
                self.partial.pop(block, None)
                full.append((block, buf))
            else:
                self.partial[block] = buf
            i = j + 1
        if self.fmt.sinks:
            self.pending.update(full)
        elif full:
            self._pack(pages, full)

    @functools.cached_property
    def kernel_args(self) -> tuple[list[int], list[int]]:
        """The page's layout and format for the C++ kernel (fixed for the store's life)."""
        return self.fmt.kernel_layout(self.n, self.d), self.fmt.kernel_format(self.n)

    def flush(self, pages: Tensor, block_table: Tensor, seq_lens: Tensor) -> None:
        """Pack the pages completed since the last call; a page that opens one of the step's sequences
        (``block_table[s, 0]``) keeps its sink tokens in full precision here."""
        if not self.pending:
            return
        lens = seq_lens.tolist()
        firsts = {int(block_table[s, 0]) for s in range(len(lens)) if lens[s] >= self.n}
        full = []
        for block, buf in self.pending.items():
            if block in firsts:
                k = self.fmt.sinks
                self.sinks[block] = buf[:, :, :k].clone()
                buf = buf.clone()
                buf[:, :, :k] = buf[:, :, k:k + 1]  # out of the page's ranges; the kernel reads them from here
            full.append((block, buf))
        self.pending.clear()
        self._pack(pages, full)

    def _pack(self, pages: Tensor, full: list[tuple[int, Tensor]]) -> None:
        blocks = torch.tensor([b for b, _ in full], dtype=torch.long)
        kv = torch.stack([buf for _, buf in full], dim=1)  # [2, P, H, n, d]
        packed = self.fmt.encode(kv[0], kv[1])
        pages[blocks, :, : packed.shape[-1]] = packed


NEG_INF = float("-inf")


def _merge(state: list[Tensor], q: Tensor, qpos: Tensor, k: Tensor, v: Tensor, first: int) -> None:
    """Fold keys/values [H, keys, d] at positions first.. into the running (max, sum, output) of q [H, rows, d]."""
    m, lsum, acc = state
    scores = q @ k.transpose(1, 2)
    kpos = torch.arange(first, first + k.shape[1])
    scores.masked_fill_(kpos[None, None, :] > qpos[None, :, None], NEG_INF)  # causal, by absolute position
    m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
    safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))  # rows that saw no key yet
    p = torch.exp(scores - safe)
    corr = torch.exp(m - safe)
    state[:] = [m_new, lsum * corr + p.sum(-1, keepdim=True), acc * corr + p @ v]


def paged_attention(query: Tensor, store: PagedStore, pages: Tensor, block_table: Tensor, seq_lens: Tensor,
                    query_start_loc: Tensor, scale: float, out: Tensor | None = None,
                    pages_per_step: int = 16, kernel: bool = True) -> Tensor:
    """Causal attention of ``query`` [T, Hq, d] (each sequence's queries are its last tokens) over the packed
    pages named by ``block_table`` [S, max_blocks], the store's sink tokens and its partial pages; returns
    [T, Hq, d].

    kvsqueeze's C++ kernel reads every sequence's pages in place, one call for the step
    (:func:`kvsqueeze.kernels.cpu.attend_paged`); where it is not built, or with ``kernel=False``, the reference
    here decodes ``pages_per_step`` pages of a sequence at a time and merges them by an online softmax."""
    n = store.n
    store.flush(pages, block_table, seq_lens)
    if out is None:
        out = torch.empty_like(query)
    qsl, lens, rows = query_start_loc.tolist(), seq_lens.tolist(), block_table.tolist()
    if kernel:
        from . import cpu

        exact = []  # per sequence: its sink copies and its partial page, or None
        for length, row in zip(lens, rows):
            n_full, tail = divmod(length, n)
            exact.append(store.sinks.get(row[0]) if n_full else None)
            exact.append(store.partial.get(row[n_full]) if tail else None)
        layout, fmt_ints = store.kernel_args
        res = cpu.attend_paged(query, pages, block_table, seq_lens, query_start_loc, exact, n, layout, fmt_ints,
                               store.fmt.sinks, scale)
        if res is not None:
            out[: res.shape[0]] = res
            return out
    for s, length in enumerate(lens):
        q0, q1 = qsl[s], qsl[s + 1]
        if q1 == q0:
            continue
        n_full, tail = divmod(length, n)
        row = rows[s]
        buf = None
        if tail:
            buf = store.partial.get(row[n_full])
            if buf is None:
                raise RuntimeError(f"paged KV: the partial page of sequence {s} (block {row[n_full]}) "
                                   f"has no stored tokens")
        sinks = store.sinks.get(row[0]) if n_full else None
        res = _reference_sequence(query[q0:q1], store, pages, block_table[s], length, buf, sinks, scale,
                                  pages_per_step)
        out[q0:q1] = res.to(out.dtype)
    return out


def _reference_sequence(query: Tensor, store: PagedStore, pages: Tensor, row: Tensor, length: int,
                        buf: Tensor | None, sinks: Tensor | None, scale: float, pages_per_step: int) -> Tensor:
    """One sequence's attention [ql, Hq, d] in torch: pages decoded a few at a time (the first page's sink tokens
    taken from ``sinks``), merged by log-sum-exp."""
    n, h, d = store.n, store.h, store.d
    ql, hq = query.shape[:2]
    rep = hq // h
    # [H, rep * ql, d]: query heads grouped by their KV head (head i reads KV head i // rep)
    q = query.float().transpose(0, 1).reshape(h, rep * ql, d) * scale
    qpos = torch.arange(length - ql, length).repeat(rep)  # absolute position of each query row
    state = [torch.full((h, rep * ql, 1), NEG_INF), torch.zeros((h, rep * ql, 1)), torch.zeros((h, rep * ql, d))]
    n_full, tail = divmod(length, n)
    for p0 in range(0, n_full, pages_per_step):
        p1 = min(p0 + pages_per_step, n_full)
        k, v = store.fmt.decode(pages[row[p0:p1].long()], n, d)  # [P, H, n, d]
        if p0 == 0 and sinks is not None:
            k[0, :, : sinks.shape[2]], v[0, :, : sinks.shape[2]] = sinks[0].float(), sinks[1].float()
        _merge(state, q, qpos, k.transpose(0, 1).reshape(h, -1, d), v.transpose(0, 1).reshape(h, -1, d), p0 * n)
    if tail:
        _merge(state, q, qpos, buf[0, :, :tail].float(), buf[1, :, :tail].float(), n_full * n)
    _, lsum, acc = state
    return (acc / lsum).reshape(h, rep, ql, d).permute(2, 0, 1, 3).reshape(ql, hq, d)


PAGE_TOKENS = 32  # vLLM block size the plugin runs: a page is one KIVI key group (the kivi presets group 32 tokens)
CELL_ALIGN = 4  # vLLM views a (head, token) cell in the model's dtype (up to 4 bytes): cells are whole elements


def pool_cell_bytes(fmt: PagedFormat, head_dim: int, block_size: int = PAGE_TOKENS) -> int:
    """Bytes vLLM allocates per (KV head, token) for ``fmt``: the page's bytes over its tokens, rounded up."""
    return -(-fmt.token_bytes(block_size, head_dim) // CELL_ALIGN) * CELL_ALIGN


def pool_bits_per_element(fmt: PagedFormat, block_size: int, head_dim: int) -> float:
    """Bits per K/V element of a packed page as the pool stores it (the cell rounded up to whole elements)."""
    return 8 * pool_cell_bytes(fmt, head_dim, block_size) / (2 * head_dim)


__all__ = ["FORMATS", "PAGE_TOKENS", "pool_cell_bytes", "PagedFormat", "PagedStore", "paged_attention", "paged_format", "pool_bits_per_element"]
