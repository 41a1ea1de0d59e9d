"""The segment plan: what one attention step reads, in token order, as typed parts with absolute positions.

A layer of the cache produces one :class:`SegmentPlan` per step (:meth:`kvsqueeze.cache.layer.LayerKV.plan`):
sinks, the packed history blocks, the full-precision window and the step's new tokens.  Every attention kernel
(the reference, the C++ CPU kernel, the Triton kernels) consumes this and nothing else of the cache: exact
segments hand over their K/V tensors; stored segments hand over the parts as stored (described by the plan's
key/value :class:`~kvsqueeze.quant.format.StorageFormat`) and a decoder bound by the cache, which the
reference uses and the fast kernels never need.  This module holds types only and imports nothing of the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..quant.format import StorageFormat

EXACT, STORED = "exact", "stored"


class Memo(dict):
    """A kernel's derived data on a run of stored segments: a copied or pickled cache starts without it (it may
    hold native objects, and is rebuilt on first use)."""

    def __deepcopy__(self, memo) -> Memo:
        return Memo()

    def __reduce__(self):
        return (Memo, ())


@dataclass(frozen=True)
class Segment:
    """``length`` tokens starting at absolute position ``start``.

    kind "exact":  ``k``/``v`` [B, H, length, D] in the model's dtype (sinks, window, new tokens).
    kind "stored": ``k_parts``/``v_parts`` are one block's stored tensors [B, H, rows, ...] by part name, of
                   which the first ``length`` tokens are valid (blocks are preallocated); ``decode()`` returns
                   the valid tokens' (k, v) in float32.
    is_new:        the step's own tokens: causal among themselves when no mask is given.
    """

    kind: str
    start: int
    length: int
    is_new: bool = False
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    k_parts: Mapping[str, torch.Tensor] = field(default_factory=dict)
    v_parts: Mapping[str, torch.Tensor] = field(default_factory=dict)
    decode: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None

    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of this segment: as held for exact segments, decoded for stored ones."""
        if self.kind == EXACT:
            return self.k, self.v
        return self.decode()


@dataclass(frozen=True)
class PoolRun:
    """What a kernel needs to read a store's tokens from its pool: ``parts`` by side and name (e.g.
    ``parts["k"]["codes"]``, each ``[slots, B, H, rows, ...]``), the block ``table`` (int32, store block -> slot),
    ``first`` (store index of the first stored token), ``n_tokens`` stored tokens from there, ``start`` (absolute
    position of the first), ``block_tokens`` tokens per slot."""

    parts: dict[str, dict[str, torch.Tensor]]
    table: torch.Tensor
    first: int
    n_tokens: int
    start: int
    block_tokens: int


class PoolTarget(NamedTuple):
    """Where an encoder may write one side's new tokens in place (a pooled store): that side's pool tensors by part
    name ([slots, B, H, rows, ...]), the block table (every slot the tokens reach already in it), the store index
    of the first new token and the tokens per slot."""

    parts: dict[str, torch.Tensor]
    table: torch.Tensor
    start: int
    block_tokens: int


@dataclass(frozen=True)
class SegmentPlan:
    """Everything one layer's attention step reads: ``segments`` = ``before`` (sinks) + ``stored`` (the packed full
    blocks) + ``after`` (a packed block still filling, the window, the step's new tokens).

    stored: the store hands over the same tuple, with the same ``stored_memo``, for as long as its full blocks are
    unchanged, so a kernel keeps what it derives from them there (a decode step then costs the same whatever the
    number of blocks).  key_format / value_format: how stored segments are stored.  key_shared / value_shared:
    tensors shared by every stored token of a side (fp8 per-head / per-tensor scales), by name.  first_visible:
    absolute position of the first token still stored (mask columns are positions minus this).  query_start:
    absolute position of the first new token.  flush_tokens: stored segments hold whole token groups of this size.
    pool: where every stored segment's tokens (the full blocks and a block still filling) lie as slots of one tensor
    per part, when the store keeps a pool (device caches; cache/pool.py): a kernel may read them all from there.
    """

    before: tuple[Segment, ...]
    stored: tuple[Segment, ...]
    after: tuple[Segment, ...]
    key_format: StorageFormat | None
    value_format: StorageFormat | None
    first_visible: int
    query_start: int
    flush_tokens: int = 1
    key_shared: Mapping[str, torch.Tensor] = field(default_factory=dict)
    value_shared: Mapping[str, torch.Tensor] = field(default_factory=dict)
    stored_memo: dict = field(default_factory=lambda: Memo(), compare=False, repr=False)
    pool: PoolRun | None = field(default=None, compare=False, repr=False)

    @property
    def segments(self) -> tuple[Segment, ...]:
        return self.before + self.stored + self.after

    @property
    def new(self) -> Segment | None:
        return next((s for s in self.segments if s.is_new), None)

    def kv_length(self, query_length: int) -> int:
        """Mask columns attention sees for ``query_length`` new tokens."""
        return self.query_start - self.first_visible + query_length

    def decoded(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, bool]]:
        """(start, k, v, is_new) per segment in token order, stored blocks decoded one at a time."""
        for seg in self.segments:
            if seg.length:
                k, v = seg.values()
                yield seg.start, k, v, seg.is_new

    def check_mask(self, mask: torch.Tensor | None, query_length: int) -> None:
        """A mask must cover every query row and every visible key column; never read past it."""
        kv_len = self.kv_length(query_length)
        if mask is not None and (mask.dim() != 4 or mask.shape[-1] < kv_len or mask.shape[-2] != query_length):
            raise RuntimeError(f"attention mask of shape {tuple(mask.shape)} does not cover {query_length} queries "
                               f"x {kv_len} key positions")
