"""One layer's stored blocks as slots of one tensor per part, with a block table (device caches).

A GPU kernel that walks a long history wants one address space: with every block its own tensor, the Triton decode
took one launch per block (128 per layer at 32k tokens).  Here each part of a store ("k.codes", "v.scale", ...)
lives in one tensor ``[slots, B, H, rows, ...]``; a block is a slot (its parts are views of it, so the block
store's writes and reads are unchanged), and ``table[j]`` holds the slot of the store's block ``j`` (counted from
the store's first token ever, so an eviction only moves where the walk starts).  A kernel then reads token ``u``
of the store at slot ``table[u // block_tokens]``, row ``u % block_tokens``, in one launch.

Writing the table for a new block is a one-element fill on the device: no host synchronisation in a decode step.
When the slots run out the pool grows by half (a device copy of the used slots, amortised like a list's growth) and
the blocks' part views are re-pointed; everything derived from the old views must then be rebuilt (``generation``).
"""

from __future__ import annotations

import torch

from ..quant.format import PartLayout
from .plan import PoolRun

FIRST_SLOTS = 4


class BlockPool:
    def __init__(self, layouts: dict[str, PartLayout], batch: int, heads: int, block_tokens: int,
                 device: torch.device):
        self.layouts, self.batch, self.heads, self.block_tokens = layouts, batch, heads, block_tokens
        self.device = device
        self.tensors = {key: self._alloc(lay, FIRST_SLOTS) for key, lay in layouts.items()}
        self.free = list(range(FIRST_SLOTS - 1, -1, -1))
        self.owners: dict[int, dict[str, torch.Tensor]] = {}  # slot -> the parts dict of the block holding it
        self.table = torch.zeros(FIRST_SLOTS, dtype=torch.int32, device=device)
        self.generation = 0  # bumped whenever part views were re-pointed

    def __deepcopy__(self, memo) -> BlockPool:
        # a copied store copies its blocks into slots of its own (BlockStore.__deepcopy__)
        return BlockPool(self.layouts, self.batch, self.heads, self.block_tokens, self.device)

    def _alloc(self, lay: PartLayout, slots: int) -> torch.Tensor:
        rows = self.block_tokens // lay.tokens_per_row
        return torch.empty((slots, self.batch, self.heads, rows, *lay.tail), dtype=lay.dtype, device=self.device)

    @property
    def slots(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def _grow(self) -> None:
        # by half again, not double: the slots allocated stay within 1.5x of those used (a GPU's memory budget is
        # the cache's capacity), at an amortised copy of about two slots per slot added
        n = self.slots
        m = max(n + 1, n * 3 // 2)
        for key, old in self.tensors.items():
            new = self._alloc(self.layouts[key], m)
            new[:n].copy_(old)
            self.tensors[key] = new
        for slot, parts in self.owners.items():
            parts.update({key: t[slot] for key, t in self.tensors.items()})
        self.free = list(range(m - 1, n - 1, -1)) + self.free
        self.generation += 1

    def take(self, index: int) -> tuple[int, dict[str, torch.Tensor]]:
        """A free slot for the store's block ``index`` (its table entry written on the device), and its part views."""
        if not self.free:
            self._grow()
        slot = self.free.pop()
        parts = {key: t[slot] for key, t in self.tensors.items()}
        self.owners[slot] = parts
        self._reserve(index + 1)
        self.table[index] = slot  # a fill on the device: no synchronisation
        return slot, parts

    def _reserve(self, entries: int) -> None:
        """A table of at least ``entries`` entries (doubled, entries kept: a device copy)."""
        if entries > self.table.numel():
            table = torch.zeros(max(2 * self.table.numel(), entries), dtype=torch.int32, device=self.device)
            table[: self.table.numel()].copy_(self.table)
            self.table = table

    def give(self, slot: int) -> None:
        if self.owners.pop(slot, None) is not None:
            self.free.append(slot)

    def keep_only(self, live: dict[int, tuple[int, dict[str, torch.Tensor]]]) -> None:
        """After a rollback or a re-slotting: exactly the blocks ``live`` (slot -> (store block index, parts)) own
        slots, and the table says so (a host-to-device copy: rollbacks and batch edits only, not decode steps)."""
        for slot in [s for s in self.owners if s not in live]:
            self.give(slot)
        self.free = [s for s in self.free if s not in live]
        for slot, (_, parts) in live.items():  # a block that had no slot when the pool grew kept old views
            parts.update({key: t[slot] for key, t in self.tensors.items()})
            self.owners[slot] = parts
        self.generation += 1
        if live:
            self._reserve(max(i for i, _ in live.values()) + 1)
            index = torch.tensor([i for i, _ in live.values()], dtype=torch.long)
            self.table[index.to(self.device)] = torch.tensor(list(live), dtype=torch.int32).to(self.device)

    def run(self, first: int, n_tokens: int, start: int) -> PoolRun:
        parts: dict[str, dict[str, torch.Tensor]] = {"k": {}, "v": {}}
        for key, t in self.tensors.items():
            side, name = key.split(".", 1)
            parts[side][name] = t
        return PoolRun(parts, self.table, first, n_tokens, start, self.block_tokens)
