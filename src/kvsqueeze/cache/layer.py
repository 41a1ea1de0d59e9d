"""One layer's KV cache: attention sinks, quantized history, full-precision window, and the step in flight.

Token order is sinks | history (block store) | window | pending.  ``stage`` records the new tokens of a forward
step without touching stored state; attention reads the stored segments plus the exact new tokens (so a
prompt's own logits come from exact K/V); ``commit`` then moves tokens that left the window into the history,
quantizing each exactly once.  Each layer commits right after its own attention (a :class:`StepTracker` keeps the
step all-or-nothing across layers through checkpoints), so a prompt's full-precision K/V never outlive one layer.
Nothing here imports transformers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..spec import CacheSpec
from .arena import BlockArena
from .blocks import BlockStore, FastEncoder
from .factory import make_codec
from .plan import EXACT, Memo, Segment, SegmentPlan


class FpWindow:
    """Full-precision ring of recent tokens: append writes in place, dropping from the front moves a start index;
    when the buffer end is reached the live tokens are moved to its front (amortised O(1)).

    The buffer is allocated once and reused: a fresh buffer at every wrap would touch new pages every step (the
    writes walk through it) while the freed ones stay in the process heap, so RSS would climb by the buffer size
    per wrap.  The move happens in place only when neither the live tokens nor those of the last checkpoint (a
    step that fails is rolled back to it) lie where the tokens go; otherwise (an append larger than the spare
    room) a new buffer is taken, and the old one stays intact for the checkpoint."""

    def __init__(self, capacity: int):
        self.capacity = max(capacity, 1)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.start = 0
        self.length = 0
        self._kept = (0, 0)  # (start, length) of the last checkpoint in the current buffers

    def _alloc(self, like: torch.Tensor, cap: int) -> torch.Tensor:
        b, h, _, d = like.shape
        return torch.empty((b, h, cap, d), dtype=like.dtype, device=like.device)

    def _make_room(self, like: torch.Tensor, t: int) -> None:
        """Move the live tokens to the buffer front (in place where nothing needed is overwritten), or into a new,
        larger buffer."""
        need = self.length + t  # the tokens written to [0, need)
        kept_start, kept_len = self._kept
        if need <= self.k.shape[2] and self.start >= need and (kept_len == 0 or kept_start >= need):
            s, e = self.start, self.start + self.length
            self.k[:, :, : self.length] = self.k[:, :, s:e]
            self.v[:, :, : self.length] = self.v[:, :, s:e]
            self.start = 0
            return
        cap = max(self.k.shape[2], 2 * need)
        nk, nv = self._alloc(like, cap), self._alloc(like, cap)
        nk[:, :, : self.length] = self.k[:, :, self.start:self.start + self.length]
        nv[:, :, : self.length] = self.v[:, :, self.start:self.start + self.length]
        self.k, self.v, self.start, self._kept = nk, nv, 0, (0, 0)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        t = k.shape[2]
        if t == 0:
            return
        if self.k is None:
            self.k, self.v = self._alloc(k, self.capacity), self._alloc(v, self.capacity)
        if self.start + self.length + t > self.k.shape[2]:
            self._make_room(k, t)
        end = self.start + self.length
        self.k[:, :, end:end + t] = k
        self.v[:, :, end:end + t] = v
        self.length += t

    def view(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.k is None:
            return None, None
        s, e = self.start, self.start + self.length
        return self.k[:, :, s:e], self.v[:, :, s:e]

    def checkpoint(self) -> tuple:
        self._kept = (self.start, self.length)
        return self.k, self.v, self.start, self.length

    def restore(self, state: tuple) -> None:
        self.k, self.v, self.start, self.length = state

    def drop_front(self, n: int) -> None:
        self.start += n
        self.length -= n

    def truncate(self, n: int) -> None:
        self.length = min(self.length, n)

    def map_batch(self, fn) -> None:
        if self.k is not None:
            k, v = self.view()
            self.k, self.v = fn(k).contiguous(), fn(v).contiguous()
            self.start, self._kept = 0, (0, 0)

    def nbytes(self) -> tuple[int, int]:
        if self.k is None:
            return 0, 0
        per_tok = self.k[:, :, 0].numel() * self.k.element_size() * 2
        return self.length * per_tok, self.k.shape[2] * per_tok


class StepTracker:
    """Makes a forward step all-or-nothing across layers, while each layer commits as soon as its own attention is
    done (so no layer holds the step's K/V in full precision longer than its attention needs them: a long prompt's
    full-precision part stays one layer's chunk).  A layer records a checkpoint before it commits; the checkpoints
    are dropped once every layer is done.  A step that raised part-way is rolled back by :meth:`abort` (from the
    failing attention) or by :meth:`settle`, which the cache calls before anything reads or edits it."""

    def __init__(self, layers: Callable[[], list[LayerKV]]):
        self._layers = layers  # a getter: layers are replaced on reset
        self.saved: dict[int, tuple[LayerKV, tuple]] = {}

    @property
    def layers(self) -> list[LayerKV]:
        return self._layers()

    def layer_done(self, layer: LayerKV) -> None:
        self.saved[id(layer)] = (layer, layer.checkpoint())
        layer.commit()
        if len(self.saved) == len(self.layers):
            self.saved.clear()

    def abort(self) -> None:
        for layer, state in self.saved.values():
            layer.restore(state)
        self.saved.clear()
        for lay in self.layers:
            lay.pending = None

    def settle(self) -> None:
        if self.saved or any(lay.pending is not None for lay in self.layers):
            self.abort()


class LayerKV:
    """Storage and bookkeeping of one attention layer.

    sliding_window: for sliding-window layers, tokens no query can see any more are evicted block by block.
    """

    def __init__(self, spec: CacheSpec, sliding_window: int | None = None):
        self.spec = spec
        self.sliding_window = sliding_window
        self.n_total = 0  # committed tokens, including evicted ones
        self.sink_k: torch.Tensor | None = None
        self.sink_v: torch.Tensor | None = None
        self.store: BlockStore | None = None
        # room for the live window (< window + flush tokens) twice over plus one flush: a wrap then moves the tokens
        # in place even in a step that also flushed (see FpWindow)
        self.window = FpWindow(2 * spec.window + 3 * spec.flush_tokens)
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.shape: tuple[int, int, int] | None = None  # batch, kv heads, head_dim
        self.dtype: torch.dtype | None = None
        self.backend = "torch"  # attention backend name and its resolved function (set by the adapter)
        self.attend = None
        self.fast_encode: FastEncoder | None = None  # handed to the block store (set by the adapter)
        self.arena: BlockArena | None = None  # likewise: where its CPU blocks are carved from (one per cache)
        # blocks as slots of one pool per part (cache/pool.py), which the Triton decode walks in one launch: None =
        # on devices other than the CPU (the C++ kernel takes blocks where they are)
        self.pooled: bool | None = None
        self.step: StepTracker | None = None  # shared by the layers of one cache: commits whole steps

    # ------------------------------------------------------------------ sizes
    @property
    def n_sinks(self) -> int:
        return 0 if self.sink_k is None else self.sink_k.shape[2]

    @property
    def n_history(self) -> int:
        return 0 if self.store is None else self.store.n_tokens

    @property
    def first_visible(self) -> int:
        """Absolute position of the first token still stored (0 unless a sliding layer evicted some)."""
        if self.store is None or self.store.begin == 0:
            return 0
        return self.n_sinks + self.store.begin

    def seq_length(self) -> int:
        return self.n_total + (0 if self.pending is None else self.pending[0].shape[2])

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of what attention will see for ``query_length`` new tokens."""
        if self.pending is not None:
            self.commit()
        first = self.first_visible
        return self.n_total - first + query_length, first

    # ------------------------------------------------------------------ writing
    def check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.dim() != 4 or k.shape != v.shape[:3] + (k.shape[3],) or k.shape[:3] != v.shape[:3]:
            raise ValueError(f"keys and values must be [batch, kv_heads, tokens, head_dim]; got {tuple(k.shape)} "
                             f"and {tuple(v.shape)}")
        if k.shape[3] != v.shape[3]:
            raise ValueError("keys and values with different head_dim are not supported")
        if self.shape is not None and (k.shape[0], k.shape[1], k.shape[3]) != self.shape:
            raise ValueError(f"this cache holds batch={self.shape[0]}, kv_heads={self.shape[1]}, "
                             f"head_dim={self.shape[2]}; got {tuple(k.shape)}")
        if self.shape is None:
            self.spec.check_head_dim(k.shape[3])

    def stage(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Record a forward step's new tokens (validated first; stored state untouched until commit)."""
        self.check(k, v)
        if self.pending is not None:
            if self.step is not None:  # the previous step never finished in every layer: it failed
                self.step.abort()
            else:
                self.commit()
        if self.shape is None:
            self._init(k)
        self.pending = (k, v)

    def finish_step(self) -> None:
        """Attention for the pending tokens is done: commit now, or when every layer of the step is done."""
        if self.step is None:
            self.commit()
        else:
            self.step.layer_done(self)

    def _init(self, k: torch.Tensor) -> None:
        b, h, _, d = k.shape
        self.shape, self.dtype = (b, h, d), k.dtype
        kc, vc = make_codec(self.spec.key, d, k.dtype), make_codec(self.spec.value, d, k.dtype)
        self.store = BlockStore(kc, vc, b, h, self.spec.block_tokens, k.device)
        self.store.fast_encode = self.fast_encode
        self.store.arena = self.arena
        if self.pooled or (self.pooled is None and k.device.type != "cpu"):
            self.store.use_pool()

    def checkpoint(self) -> tuple:
        """The committed state, cheaply (references and counts: storage is append-only, see :meth:`restore`)."""
        return (self.n_total, self.sink_k, self.sink_v, self.window.checkpoint(),
                None if self.store is None else self.store.checkpoint())

    def restore(self, state: tuple) -> None:
        """Back to a :meth:`checkpoint` taken in the current step (what was appended since is forgotten)."""
        self.n_total, self.sink_k, self.sink_v, win, store = state
        self.window.restore(win)
        if store is not None:
            self.store.restore(store)
        self.pending = None

    def commit(self) -> None:
        """Move the pending tokens in: first sinks, then the window; tokens pushed out of the window are
        quantized exactly once, ``flush_tokens`` at a time."""
        if self.pending is None:
            return
        k, v = self.pending
        spec = self.spec
        take = min(k.shape[2], spec.sinks - self.n_sinks)
        if take > 0:
            sk, sv = k[:, :, :take], v[:, :, :take]
            self.sink_k = sk.clone() if self.sink_k is None else torch.cat([self.sink_k, sk], dim=2)
            self.sink_v = sv.clone() if self.sink_v is None else torch.cat([self.sink_v, sv], dim=2)
            k, v = k[:, :, take:], v[:, :, take:]
        rest = k.shape[2]
        f = spec.flush_tokens
        flush = max(0, self.window.length + rest - spec.window) // f * f
        if flush:
            from_w = min(flush, self.window.length)
            fk, fv = k[:, :, :flush - from_w], v[:, :, :flush - from_w]
            if from_w:
                wk, wv = self.window.view()
                fk = torch.cat([wk[:, :, :from_w], fk], dim=2)
                fv = torch.cat([wv[:, :, :from_w], fv], dim=2)
            self.store.append(fk, fv, base=self.n_sinks)
            self.window.drop_front(from_w)
            k, v = k[:, :, flush - from_w:], v[:, :, flush - from_w:]
        self.window.append(k, v)
        self.n_total += self.pending[0].shape[2]
        self.pending = None
        if self.sliding_window is not None:
            # the next query (position n_total) sees keys at positions > n_total - sliding_window
            self.store.evict_before(self.n_total - self.sliding_window + 1 - self.n_sinks)

    # ------------------------------------------------------------------ reading
    def plan(self) -> SegmentPlan:
        """What attention reads this step, in token order: sinks, stored blocks (parts as stored, decoded only on
        demand), the window, then the pending tokens."""
        before: tuple[Segment, ...] = ()
        stored: tuple[Segment, ...] = ()
        after: list[Segment] = []
        memo = Memo()
        if self.sink_k is not None and self.sink_k.shape[2]:
            before = (Segment(EXACT, 0, self.sink_k.shape[2], k=self.sink_k, v=self.sink_v),)
        store = self.store
        if store is not None:
            stored, memo, partial = store.segments(self.n_sinks)
            after.extend(partial)
            if self.window.length:
                wk, wv = self.window.view()
                after.append(Segment(EXACT, self.n_sinks + store.end, self.window.length, k=wk, v=wv))
        if self.pending is not None:
            k, v = self.pending
            after.append(Segment(EXACT, self.n_total, k.shape[2], is_new=True, k=k, v=v))
        fmts = (None, None) if store is None else (store.codecs["k"].fmt, store.codecs["v"].fmt)
        shared = ({}, {}) if store is None else (store.shared["k"], store.shared["v"])
        pool = None if store is None else store.pool_run(self.n_sinks)
        return SegmentPlan(before, stored, tuple(after), fmts[0], fmts[1], self.first_visible, self.n_total,
                           self.spec.flush_tokens, shared[0], shared[1], memo, pool)

    # ------------------------------------------------------------------ editing
    def crop(self, new_length: int) -> None:
        """Keep the first ``new_length`` tokens.  Cropping inside the window or sinks is exact; cropping into the
        history keeps whole token groups quantized and moves the decoded remainder of a partial group back to
        the window (these few tokens are then quantized once more when they leave it)."""
        self.commit()
        if new_length >= self.n_total:
            return
        if self.sliding_window is not None and self.first_visible > 0:
            raise ValueError("cannot crop a sliding-window layer after it evicted tokens")
        s, hist = self.n_sinks, self.n_history
        if new_length <= s:
            if self.sink_k is not None:  # a spec without sinks has none (a crop to 0)
                self.sink_k, self.sink_v = self.sink_k[:, :, :new_length], self.sink_v[:, :, :new_length]
            self.store.truncate(0)
            self.window.truncate(0)
        elif new_length <= s + hist:
            keep = new_length - s
            f = self.spec.flush_tokens
            aligned = keep // f * f
            leftover = self.store.decode_range(aligned, keep, base=s) if keep > aligned else None
            self.store.truncate(aligned)
            self.window.truncate(0)
            if leftover is not None:
                self.window.append(leftover[0].to(self.dtype), leftover[1].to(self.dtype))
        else:
            self.window.truncate(new_length - s - hist)
        self.n_total = new_length

    def map_batch(self, fn) -> None:
        """Apply a batch re-indexing (beam reorder, select, repeat) to everything stored."""
        self.commit()
        if self.shape is None:
            return
        if self.sink_k is not None:
            self.sink_k, self.sink_v = fn(self.sink_k), fn(self.sink_v)
        self.store.map_batch(fn)
        self.window.map_batch(fn)
        if self.window.k is not None:
            b = self.window.k.shape[0]
        elif self.store.blocks:
            b = self.store.batch
        else:
            b = self.shape[0] if self.sink_k is None else self.sink_k.shape[0]
        self.shape = (b, self.shape[1], self.shape[2])
        self.store.batch = b
        if self.store.pool is not None and self.store.pool.batch != b:  # no blocks yet: an empty pool of b
            self.store.use_pool()

    # ------------------------------------------------------------------ accounting
    def nbytes(self) -> dict[str, int]:
        out = {"codes": 0, "params": 0, "fp": 0, "allocated": 0, "elements": 0, "quantized_elements": 0}
        if self.shape is None:
            return out
        b, h, d = self.shape
        sink_bytes = 0 if self.sink_k is None else 2 * self.sink_k.numel() * self.sink_k.element_size()
        win_bytes, win_alloc = self.window.nbytes()
        store = self.store.nbytes()
        out["codes"], out["params"] = store["codes"], store["params"]
        out["fp"] = store["fp"] + sink_bytes + win_bytes
        out["allocated"] = store["allocated"] + sink_bytes + win_alloc
        stored_tokens = self.n_sinks + self.n_history + self.window.length
        out["elements"] = 2 * b * h * d * stored_tokens
        out["quantized_elements"] = b * h * d * self.n_history * (
            int(self.spec.key.quantized) + int(self.spec.value.quantized))
        return out
