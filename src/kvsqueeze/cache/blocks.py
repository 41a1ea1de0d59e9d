"""Append-only block storage for one layer's quantized (or full-precision) history.

Storage grows by whole preallocated blocks of ``block_tokens`` tokens; nothing already stored is ever copied,
re-encoded or concatenated when tokens are added.  Reading goes block by block, which bounds the memory of a
decoded chunk to one block.  The store knows token indices, not positions: callers pass the absolute position of
store index 0 (``base``) to whatever encodes or decodes.  It owns each side's shared tensors (fp8 per-head /
per-tensor scales), which its stateless codecs fill on the first encode.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .arena import BlockArena
from .codecs import Codec
from .plan import STORED, Memo, PoolRun, PoolTarget, Segment
from .pool import BlockPool

# an encoder that may replace a codec's for a format (the Triton quantize-and-pack): parts, or None to decline;
# given a PoolTarget it writes the parts into the pool's slots in place (and returns an empty dict)
FastEncoder = Callable[..., "dict[str, torch.Tensor] | None"]

SPARE_BLOCKS = 2  # dropped blocks a store keeps for its next ones (a crop or an eviction drops one at a time)


@dataclass
class _Block:
    start: int  # index of its first token within the store (counting evicted tokens)
    parts: dict[str, torch.Tensor]  # "k.codes", "v.scale", ...
    used: int = 0
    # the plan segment last built for this block and what it was built from (a decode step reuses it: only the
    # last block grows, so rebuilding every block's segment each step would cost more than the attention)
    segment: Segment | None = None
    segment_key: tuple = ()
    slot: int = -1  # its slot in the store's pool, if it has one


class BlockStore:
    def __init__(self, key_codec: Codec, value_codec: Codec, batch: int, heads: int, block_tokens: int,
                 device: torch.device):
        self.codecs = {"k": key_codec, "v": value_codec}
        self.shared: dict[str, dict[str, torch.Tensor]] = {"k": {}, "v": {}}
        self.fast_encode: FastEncoder | None = None  # set by the adapter where a faster encoder exists
        self.arena: BlockArena | None = None  # where CPU blocks come from (set by the adapter; else torch.empty)
        self.pool: BlockPool | None = None  # every block a slot of one tensor per part (use_pool; device caches)
        # blocks dropped by truncate / evict_before, reused by the next new blocks: blocks carved from an arena
        # shared by every layer would otherwise leave holes in slabs that the other layers' blocks keep alive
        self._spare: list[_Block] = []
        self.batch, self.heads, self.block_tokens, self.device = batch, heads, block_tokens, device
        self.blocks: list[_Block] = []
        self.end = 0  # tokens ever appended (minus truncations)
        self.begin = 0  # first token still stored (whole blocks are evicted for sliding-window layers)
        # segments() of the full blocks: (base, segments, memo), until anything but a flush changes them
        self._run: tuple[int, tuple[Segment, ...], Memo] | None = None

    def __getstate__(self) -> dict:
        # a copied (deepcopy / pickle) store rebuilds its segments: the cached ones decode this store's blocks
        return {**self.__dict__, "_run": None}

    def __deepcopy__(self, memo) -> BlockStore:
        # blocks are copied part by part into new blocks: copied as tensors, views of an arena's slabs would bring
        # whole slabs along (a 400 KB cache's copy took 6 MiB)
        twin = self.__class__.__new__(self.__class__)
        memo[id(self)] = twin
        state = {k: v for k, v in self.__getstate__().items() if k not in ("blocks", "_spare")}
        twin.__dict__.update(copy.deepcopy(state, memo))
        twin.blocks, twin._spare = [], []
        for blk in self.blocks:
            new = twin._new_block(blk.start)
            for key, t in blk.parts.items():
                new.parts[key].copy_(t)
            new.used = blk.used
            twin.blocks.append(new)
        return twin

    @property
    def n_tokens(self) -> int:
        return self.end - self.begin

    def use_pool(self) -> None:
        """Keep every block (those stored already too) as a slot of one tensor per part (see cache/pool.py)."""
        self.pool = BlockPool(dict(self._layouts()), self.batch, self.heads, self.block_tokens, self.device)
        self._spare = []
        for blk in self.blocks:
            blk.slot, parts = self.pool.take(blk.start // self.block_tokens)
            for key, t in blk.parts.items():
                parts[key].copy_(t)
            blk.parts = parts
        self._run = None

    def pool_run(self, base: int) -> PoolRun | None:
        """Where a kernel finds the stored tokens in the pool (absolute position of store index 0: ``base``)."""
        if self.pool is None:
            return None
        return self.pool.run(self.begin, self.n_tokens, base + self.begin)

    def _layouts(self):
        for side, codec in self.codecs.items():
            for name, lay in codec.layout().items():
                yield f"{side}.{name}", lay

    def _new_block(self, start: int) -> _Block:
        if self.pool is not None:
            slot, parts = self.pool.take(start // self.block_tokens)
            return _Block(start, parts, slot=slot)
        if self._spare:
            return _Block(start, self._spare.pop().parts)
        arena = self.arena if self.device.type == "cpu" else None
        parts = {}
        for key, lay in self._layouts():
            shape = (self.batch, self.heads, self.block_tokens // lay.tokens_per_row, *lay.tail)
            parts[key] = (arena.empty(shape, lay.dtype) if arena is not None
                          else torch.empty(shape, dtype=lay.dtype, device=self.device))
        return _Block(start, parts)

    def _drop(self, dropped: list[_Block]) -> None:
        if self.pool is not None:
            for blk in dropped:
                self.pool.give(blk.slot)
            return
        self._spare = (self._spare + dropped)[-SPARE_BLOCKS:]

    def _encode(self, side: str, x: torch.Tensor, start: int) -> dict[str, torch.Tensor]:
        codec = self.codecs[side]
        if self.fast_encode is not None and codec.fmt.plain:
            parts = self.fast_encode(codec.fmt, x)
            if parts is not None:
                return parts
        return codec.encode(x, start, self.shared[side])

    def _decode(self, side: str, parts: dict[str, torch.Tensor], start: int) -> torch.Tensor:
        return self.codecs[side].decode(parts, start, self.shared[side])

    def _encode_into_pool(self, side: str, x: torch.Tensor) -> bool:
        """Pack one side's new tokens straight into their slots (the fast encoder with a pool), if it can."""
        codec = self.codecs[side]
        if self.pool is None or self.fast_encode is None or not codec.fmt.plain:
            return False
        parts = {key.split(".", 1)[1]: t for key, t in self.pool.tensors.items() if key.startswith(f"{side}.")}
        target = PoolTarget(parts, self.pool.table, self.end, self.block_tokens)
        return self.fast_encode(codec.fmt, x, into=target) is not None

    def _blocks_for(self, t: int) -> list[_Block]:
        """New blocks for ``t`` more tokens after the last stored one (not yet in the store's list)."""
        new_blocks, last = [], (self.blocks[-1] if self.blocks else None)
        free = (self.block_tokens - last.used) if last is not None else 0
        need = t - free
        while need > 0:
            new_blocks.append(self._new_block(self.end + free + len(new_blocks) * self.block_tokens))
            need -= self.block_tokens
        return new_blocks

    def append(self, k: torch.Tensor, v: torch.Tensor, base: int = 0) -> None:
        """Encode tokens [B,H,T,D] once and write them after the last stored token (absolute position of store
        index 0: ``base``).  A failure leaves the store unchanged: blocks are taken first, but counted only once
        every part is written (a pooled store's fast encoder writes its parts into their slots directly)."""
        t = k.shape[2]
        if t == 0:
            return
        shared_before = {side: dict(d) for side, d in self.shared.items()}
        new_blocks = self._blocks_for(t)
        try:
            encoded = {}
            for side, x in (("k", k), ("v", v)):
                if not self._encode_into_pool(side, x):
                    encoded.update({f"{side}.{n}": p for n, p in self._encode(side, x, base + self.end).items()})
        except BaseException:
            self.shared = shared_before  # a scale fixed by a failed encode must not outlive it
            self._drop(new_blocks)
            raise
        layouts = dict(self._layouts())
        self.blocks.extend(new_blocks)
        written = 0
        for blk in self.blocks:
            if blk.used == self.block_tokens or blk.start + blk.used != self.end + written:
                continue
            n = min(self.block_tokens - blk.used, t - written)
            for key, src in encoded.items():
                r = layouts[key].tokens_per_row
                blk.parts[key][:, :, blk.used // r:(blk.used + n) // r] = src[:, :, written // r:(written + n) // r]
            blk.used += n
            written += n
            if written == t:
                break
        self.end += t

    def _sides(self, blk: _Block, valid: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """A block's parts split by side, as stored or (``valid``) cut to the tokens in use."""
        sides: dict[str, dict[str, torch.Tensor]] = {"k": {}, "v": {}}
        layouts = dict(self._layouts()) if valid else {}
        for key, t in blk.parts.items():
            side, name = key.split(".", 1)
            sides[side][name] = t[:, :, : blk.used // layouts[key].tokens_per_row] if valid else t
        return sides["k"], sides["v"]

    def _decoder(self, blk: _Block, base: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        def decode() -> tuple[torch.Tensor, torch.Tensor]:
            kp, vp = self._sides(blk, valid=True)
            pos = base + blk.start
            return self._decode("k", kp, pos), self._decode("v", vp, pos)

        return decode

    @property
    def _generation(self) -> int:  # a pool that grew re-pointed every block's views
        return -1 if self.pool is None else self.pool.generation

    def _segment(self, blk: _Block, base: int) -> Segment:
        key = (base, blk.used, id(blk.parts), self._generation)
        if blk.segment_key != key:
            kp, vp = self._sides(blk, valid=False)
            blk.segment = Segment(STORED, base + blk.start, blk.used, k_parts=kp, v_parts=vp,
                                  decode=self._decoder(blk, base))
            blk.segment_key = key
        return blk.segment

    def segments(self, base: int) -> tuple[tuple[Segment, ...], Memo, tuple[Segment, ...]]:
        """One stored segment per block in use, with its parts as stored and a decoder (absolute position of store
        index 0: ``base``): (the full blocks' segments, a memo for what kernels derive from them, the last block's
        segment while it is partly filled).  While the full blocks are unchanged, the same tuple and memo are
        returned: between two flushes a decode step stores nothing new, and a flush only adds to the last block."""
        # every block but the last is full (appends fill them in order; crops keep a prefix)
        n_full = len(self.blocks) - (1 if self.blocks and self.blocks[-1].used < self.block_tokens else 0)
        if self._run is None or self._run[0] != (base, self._generation) or len(self._run[1]) != n_full:
            self._run = ((base, self._generation), tuple(self._segment(blk, base) for blk in self.blocks[:n_full]),
                         Memo())
        tail = tuple(self._segment(blk, base) for blk in self.blocks[n_full:] if blk.used)
        return self._run[1], self._run[2], tail

    def chunks(self, base: int = 0) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield (first token index, keys, values) per block, decoded to float32; one block alive at a time."""
        for blk in self.blocks:
            if blk.used:
                k, v = self._decoder(blk, base)()
                yield blk.start, k, v

    def decode_range(self, a: int, b: int, base: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded tokens [a, b) (store indices); used only by crop."""
        ks, vs = [], []
        for start, k, v in self.chunks(base):
            lo, hi = max(a, start), min(b, start + k.shape[2])
            if lo < hi:
                ks.append(k[:, :, lo - start:hi - start])
                vs.append(v[:, :, lo - start:hi - start])
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)

    def checkpoint(self) -> tuple:
        """What :meth:`restore` needs to undo every append and eviction made after this call.  Blocks are only
        written past their ``used`` count and an append writes only into the last block (every earlier one is
        full) and new ones, so the block list and the last block's count are enough: taken every decode step by
        every layer, the state costs the same at any context.  A block evicted after it must not be reused before
        the restore: a layer's commit appends before it evicts, so it never is."""
        return (tuple(self.blocks), self.blocks[-1].used if self.blocks else 0, self.end, self.begin,
                {side: dict(d) for side, d in self.shared.items()})

    def restore(self, state: tuple) -> None:
        blocks, last_used, self.end, self.begin, shared = state
        self._run = None
        if blocks:
            blocks[-1].used = last_used
        self.blocks, self.shared = list(blocks), {side: dict(d) for side, d in shared.items()}
        if self.pool is not None:  # blocks appended since give their slots back, evicted ones take theirs again
            self.pool.keep_only({blk.slot: (blk.start // self.block_tokens, blk.parts) for blk in self.blocks})
            self._run = None
            return
        live = {id(blk) for blk in self.blocks}  # a block evicted since the checkpoint is stored again
        self._spare = [blk for blk in self._spare if id(blk) not in live]

    def truncate(self, n_end: int) -> None:
        """Forget tokens from store index ``n_end`` on (must fall on a token-group boundary)."""
        self._run = None
        keep, dropped = [], []
        for blk in self.blocks:
            if blk.start >= n_end:
                dropped.append(blk)
                continue
            blk.used = min(blk.used, n_end - blk.start)
            keep.append(blk)
        self.blocks = keep
        self._drop(dropped)
        self.end = max(min(self.end, n_end), self.begin)

    def evict_before(self, index: int) -> None:
        """Drop whole blocks whose tokens all precede store index ``index`` (sliding-window layers)."""
        self._run = None
        while self.blocks and self.blocks[0].used == self.block_tokens and \
                self.blocks[0].start + self.block_tokens <= index:
            self._drop([self.blocks.pop(0)])
        self.begin = self.blocks[0].start if self.blocks else self.end

    def map_batch(self, fn) -> None:
        """Apply ``fn`` (index_select / repeat_interleave on dim 0) to every stored tensor, shared ones included
        (fp8 per-head and per-tensor scales have one row per sequence)."""
        self._run = None
        self._spare = []  # of the old batch size
        for blk in self.blocks:
            blk.parts = {k: fn(t) for k, t in blk.parts.items()}
            blk.segment, blk.segment_key = None, ()
        for side in self.shared.values():
            for name, t in side.items():
                if t.dim() == 4 and t.shape[0] == self.batch:
                    side[name] = fn(t)
        if self.blocks:
            self.batch = next(iter(self.blocks[0].parts.values())).shape[0]
        if self.pool is not None and self.blocks:  # the new batch's blocks in a pool of their own
            self.use_pool()

    def nbytes(self) -> dict[str, int]:
        """Bytes of the stored tokens by kind (codes / params / fp), and the bytes allocated in blocks."""
        out = {"codes": 0, "params": 0, "fp": 0, "allocated": 0}
        layouts = dict(self._layouts())
        for blk in self.blocks:
            for key, t in blk.parts.items():
                lay = layouts[key]
                row_bytes = t[0, 0, 0].numel() * t.element_size() if t.shape[2] else 0
                out[lay.kind] += self.batch * self.heads * (blk.used // lay.tokens_per_row) * row_bytes
                out["allocated"] += t.numel() * t.element_size()
        for blk in self._spare:
            out["allocated"] += sum(t.numel() * t.element_size() for t in blk.parts.values())
        if self.pool is not None:  # the pool's free slots are allocated too
            out["allocated"] += sum(t[0].numel() * t.element_size() * len(self.pool.free)
                                    for t in self.pool.tensors.values()) + self.pool.table.numel() * 4
        for side, codec in self.codecs.items():
            for t in (*codec.constants().values(), *self.shared[side].values()):
                out["params"] += t.numel() * t.element_size()
                out["allocated"] += t.numel() * t.element_size()
        return out
