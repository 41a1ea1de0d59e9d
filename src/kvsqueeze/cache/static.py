"""One layer of a static-shape quantized cache: a decode step that ``torch.compile`` can capture.

The dynamic layer (:mod:`.layer`) grows blocks, moves a window and branches on token counts in Python; a compiled
graph would bake those counts in.  Here every tensor is allocated once for ``max_len`` tokens and a one-token step
changes no Python state, only tensors, in place:

* attention sinks: the first S tokens (the spec's ``sinks``) in a buffer of their own, full precision; the tokens
  after them are the body, body token ``u`` being token ``S + u``;
* packed history: body token ``u`` at row ``u // tokens_per_row`` of each stored part (no blocks, no table); the
  first ``nq(m) = G * max(0, (m - W) // G)`` of the ``m`` body tokens are stored there (W: the spec's window, G: its
  ``flush_tokens``), as in the dynamic layer, whose window holds W to W + G - 1 tokens;
* the rest, full precision, in a ring of ``R = W + 2G`` slots, body token ``u`` at slot ``u % R``;
* ``count`` = n = S + m tokens, a 0-dim device tensor.

A decode step writes its token into the ring (or the sinks, while fewer than S are held) and counts it
(:meth:`write_token`); attention reads the sinks, the packed ``[0, nq(m - 1))`` and the ring's
``[nq(m - 1), m)`` (:meth:`plan_from`, from the tensors the compiled graph hands over); then :meth:`flush` (run by
the attention operator, kernels/static_op.py) encodes the group ``[nq(n) - G, nq(n))`` from the ring into its
rows.  It does so every step, new group or not: encoding the same exact tokens again writes the same codes, so the step never branches on
a value.  The ring holds the last R tokens, which always include that group (R >= W + 2G - 1).  A prompt (any
length, eager) attends exactly as the dynamic layer's and is then committed (:meth:`commit`).

Not served here (refused in one line): sliding-window layers, formats whose encoding depends on the position
(pre-RoPE keys) or on tensors shared across tokens (fp8 per-head / per-tensor scales).
"""

from __future__ import annotations

import torch

from ..spec import CacheSpec
from .factory import make_codec
from .plan import EXACT, STORED, Memo, Segment, SegmentPlan


def static_refusal(spec: CacheSpec, sliding: bool) -> str | None:
    """Why a static layer cannot hold this spec, or None."""
    if sliding:
        return "sliding-window layers (the static cache serves models whose layers all attend globally)"
    if spec.layer_overrides is not None:
        return "calibrated per-layer formats"
    for side in (spec.key, spec.value):
        if side.extras is not None:
            return "calibrated extras (permutations, transforms, pre-RoPE keys)"
        if side.fmt.startswith("fp8") and side.fp8_scale != "token":
            return "fp8 with per-head or per-tensor scales (fixed by the first tokens)"
    return None


class StaticLayerKV:
    """One layer's static storage (module docstring); allocated at the first tokens (their batch, heads, dtype)."""

    def __init__(self, spec: CacheSpec, max_len: int):
        why = static_refusal(spec, False)
        if why is not None:
            raise ValueError(f"the static cache does not serve {why}")
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_cache_len must be a positive int, got {max_len!r}")
        self.spec = spec
        self.G = spec.flush_tokens
        self.W = spec.window
        self.S = spec.sinks
        self.R = self.W + 2 * self.G
        self.rows = -(-max(max_len - self.S, 1) // self.G) * self.G  # body tokens, whole groups (a flush writes G)
        self.max_len = self.S + self.rows
        self.parts: dict[str, torch.Tensor] = {}  # "k.codes", "v.scale", ... [B, H, rows, ...]
        self.ring_k: torch.Tensor | None = None
        self.ring_v: torch.Tensor | None = None
        self.count: torch.Tensor | None = None
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._stored: tuple | None = None  # (key, stored segments, memo): see _stored_segments
        self._shared: tuple[dict, dict] = ({}, {})  # no shared tensors; the same dicts every step (kernels' memo key)
        self.padded = False  # a prompt hid some of its positions (padding): decode steps must read the mask
        # (fmt, ring, parts, count, S, W, G, rows) -> bool: a flush encoded in place from the ring with the count
        # read on the device (set by the adapter where the Triton pack runs); False / None: the torch codec
        self.ring_encode = None

    # ------------------------------------------------------------------ storage
    def allocate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        b, h, _, d = k.shape
        dev = k.device
        self.codecs = {"k": make_codec(self.spec.key, d, k.dtype), "v": make_codec(self.spec.value, d, v.dtype)}
        for side, codec in self.codecs.items():
            for name, lay in codec.layout().items():
                rows = self.rows // lay.tokens_per_row
                self.parts[f"{side}.{name}"] = torch.zeros((b, h, rows, *lay.tail), dtype=lay.dtype, device=dev)
        # zeros, not empty: a step's flush re-encodes ring slots before they hold tokens (its rows are not read yet)
        self.ring_k = torch.zeros((b, h, self.R, d), dtype=k.dtype, device=dev)
        self.ring_v = torch.zeros((b, h, self.R, v.shape[-1]), dtype=v.dtype, device=dev)
        self.sink_k = torch.zeros((b, h, self.S, d), dtype=k.dtype, device=dev)
        self.sink_v = torch.zeros((b, h, self.S, v.shape[-1]), dtype=v.dtype, device=dev)
        self.count = torch.zeros((), dtype=torch.int64, device=dev)
        # the step's groups in ring slots and part rows, relative to a group's first token
        self._g = torch.arange(self.G, device=dev)

    @property
    def allocated(self) -> bool:
        return self.count is not None

    @property
    def shape(self) -> tuple[int, ...] | None:
        """[B, H, ring slots, D] once allocated (the batch is what reports read)."""
        return None if self.ring_k is None else tuple(self.ring_k.shape)

    STATE = 5  # tensors() before the parts: count, ring keys, ring values, sink keys, sink values

    def tensors(self) -> list[torch.Tensor]:
        """What attention reads: count, ring keys, ring values, sink keys, sink values, the parts by name."""
        return [self.count, self.ring_k, self.ring_v, self.sink_k, self.sink_v,
                *(self.parts[n] for n in sorted(self.parts))]

    def n_stored(self, n: int) -> int:
        """Body tokens stored packed when the layer holds n tokens."""
        return self.G * max(0, (n - self.S - self.W) // self.G)

    def _side_parts(self, parts: dict[str, torch.Tensor], side: str, rows_of) -> dict[str, torch.Tensor]:
        return {key.split(".", 1)[1]: rows_of(t, self.codecs[side].layout()[key.split(".", 1)[1]].tokens_per_row)
                for key, t in parts.items() if key.startswith(side + ".")}

    def reset(self) -> None:
        """Empty, keeping every tensor (a compiled graph is specialised to them)."""
        if self.allocated:
            self.count.zero_()
        self.pending, self.padded = None, False
        self.reset_derived()

    def reset_derived(self) -> None:
        """Forget what kernels derived from the tensors' contents (after they were rewritten in place)."""
        self._stored = None

    # ------------------------------------------------------------------ a decode step (traced)
    def write_token(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The step's token into the ring, or into the sinks while fewer than S are held (it is then also written to
        a ring slot no window reads before a later token takes it: no branch)."""
        if self.S:
            i = torch.clamp(self.count, max=self.S - 1).view(1)
            sink = self.count < self.S
            self.sink_k.index_copy_(2, i, torch.where(sink, k, self.sink_k.index_select(2, i)))
            self.sink_v.index_copy_(2, i, torch.where(sink, v, self.sink_v.index_select(2, i)))
        slot = torch.remainder(self.count - self.S, self.R).view(1)
        self.ring_k.index_copy_(2, slot, k)
        self.ring_v.index_copy_(2, slot, v)
        self.count.add_(1)

    def flush(self, tensors: list[torch.Tensor] | None = None) -> None:
        """Encode the group ending at nq(n) from the ring into its rows (every step; see the module docstring), in
        ``tensors`` (:meth:`tensors`' order; the attention operator hands over what the graph passed it).  Run
        eagerly on a CPU, where reading the count costs nothing, only the steps that complete a group do it."""
        count, ring_k, ring_v, k_parts, v_parts = self.split(tensors or self.tensors())
        if count.device.type == "cpu" and not torch.compiler.is_compiling():
            n = int(count)
            if self.n_stored(n) == self.n_stored(n - 1):  # this step completed no group
                return
        rest = {side: (ring, parts) for side, ring, parts in (("k", ring_k, k_parts), ("v", ring_v, v_parts))
                if self.ring_encode is None or not self.ring_encode(self.codecs[side].fmt, ring, parts, count, self.S,
                                                                    self.W, self.G, self.rows)}
        if not rest:  # one launch per side did it (the adapter's Triton pack, reading the count on the device)
            return
        nq = torch.clamp(torch.div(count - self.S - self.W, self.G, rounding_mode="floor"), min=1) * self.G
        first = torch.clamp(nq - self.G, max=self.rows - self.G)  # a step past max_len is refused by attention
        slots = torch.remainder(first + self._g, self.R)
        self._write(first, {side: ring.index_select(2, slots) for side, (ring, _) in rest.items()},
                    {side: parts for side, (_, parts) in rest.items()})

    def _write(self, first, xs: dict[str, torch.Tensor], into: dict | None = None) -> None:
        """Encode whole groups of tokens ``xs`` (side -> [B, H, t, D]) starting at ``first`` (a token index, int or
        0-dim tensor) into their rows of ``into`` (side -> part name -> tensor; the layer's own parts by default)."""
        for side, x in xs.items():
            t = x.shape[2]
            for name, part in self.codecs[side].encode(x).items():
                dst = into[side][name] if into is not None else self.parts[f"{side}.{name}"]
                tpr = self.codecs[side].layout()[name].tokens_per_row
                rows = torch.arange(t // tpr, device=dst.device) + torch.div(first, tpr, rounding_mode="floor")
                dst.index_copy_(2, rows, part.to(dst.dtype))

    # ------------------------------------------------------------------ a prompt (eager)
    def stage(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n0 = int(self.count)
        if n0 + k.shape[2] > self.max_len:
            raise ValueError(f"the static cache holds {self.max_len} tokens; {n0} stored + {k.shape[2]} new do not "
                             "fit (make it with a larger max_cache_len)")
        self.pending = (k, v)

    def commit(self) -> None:
        """Store the staged tokens: sinks first, then the body's groups that left the window encoded, the ring
        refilled."""
        k, v = self.pending
        self.pending = None
        n0 = int(self.count)
        n1 = n0 + k.shape[2]
        to_sinks = max(0, min(n1, self.S) - n0)
        if to_sinks:
            self.sink_k[:, :, n0:n0 + to_sinks] = k[:, :, :to_sinks]
            self.sink_v[:, :, n0:n0 + to_sinks] = v[:, :, :to_sinks]
            k, v = k[:, :, to_sinks:], v[:, :, to_sinks:]
        m0, m1 = max(n0 - self.S, 0), max(n1 - self.S, 0)  # body tokens before and after
        a, b = self.n_stored(n0), self.n_stored(n1)
        window = self._ring(self.ring_k, self.ring_v, a, m0)
        ek = torch.cat([*(seg.k for seg in window), k], 2)  # exact body tokens [a, m1)
        ev = torch.cat([*(seg.v for seg in window), v], 2)
        if b > a:
            self._write(a, {"k": ek[:, :, : b - a], "v": ev[:, :, : b - a]})
        keep = max(a, m1 - self.R)
        slots = torch.remainder(torch.arange(keep, m1, device=k.device), self.R)
        self.ring_k.index_copy_(2, slots, ek[:, :, keep - a:])
        self.ring_v.index_copy_(2, slots, ev[:, :, keep - a:])
        self.count.fill_(n1)

    # ------------------------------------------------------------------ what attention reads
    def _named(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """:meth:`tensors` as a step hands them over -> count, ring keys, ring values, parts by "side.name"."""
        count, ring_k, ring_v = tensors[:3]
        return count, ring_k, ring_v, dict(zip(sorted(self.parts), tensors[self.STATE:]))

    def split(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict, dict]:
        """:meth:`tensors` as a step hands them over -> count, ring keys, ring values, key parts, value parts (all
        rows) by part name."""
        count, ring_k, ring_v, parts = self._named(tensors)
        whole = lambda t, tpr: t  # noqa: E731
        return count, ring_k, ring_v, self._side_parts(parts, "k", whole), self._side_parts(parts, "v", whole)

    def _ring(self, ring_k, ring_v, a: int, b: int, is_new: bool = False) -> list[Segment]:
        """Body tokens [a, b) of the ring as views (one, or two where they wrap), not copies."""
        out = []
        while a < b:
            s = a % self.R
            e = min(s + b - a, self.R)
            out.append(Segment(EXACT, self.S + a, e - s, is_new=is_new, k=ring_k[:, :, s:e], v=ring_v[:, :, s:e]))
            a += e - s
        return out

    def _stored_segments(self, parts: dict[str, torch.Tensor], nq: int) -> tuple[tuple[Segment, ...], Memo]:
        """The packed rows [0, nq) as one stored segment, and the memo kernels keep what they derive from it in: both
        kept while nq and the tensors stay (a flush changes nq once per group of tokens)."""
        key = (nq, tuple(t.data_ptr() for t in parts.values()))
        if self._stored is None or self._stored[0] != key:
            stored: tuple[Segment, ...] = ()
            if nq:
                def rows(t, tpr):
                    return t[:, :, : nq // tpr]
                kp, vp = self._side_parts(parts, "k", rows), self._side_parts(parts, "v", rows)
                stored = (Segment(STORED, self.S, nq, k_parts=kp, v_parts=vp,
                                  decode=lambda: (self.codecs["k"].decode(kp), self.codecs["v"].decode(vp))),)
            self._stored = (key, stored, Memo())
        return self._stored[1], self._stored[2]

    def plan_from(self, tensors: list[torch.Tensor], query_length: int) -> SegmentPlan:
        """The plan of a step whose ``query_length`` tokens are the last ones counted (a decode step: written to the
        ring already) or staged (a prompt), from :meth:`tensors` as the step hands them over."""
        count, ring_k, ring_v, parts = self._named(tensors)
        staged = self.pending is not None
        n = int(count) + (query_length if staged else 0)
        if n > self.max_len:
            raise RuntimeError(f"the static cache holds {self.max_len} tokens; this step needs {n} (make it with a "
                               "larger max_cache_len)")
        n0 = n - query_length
        nq = self.n_stored(n0)
        stored, memo = self._stored_segments(parts, nq)
        sink_k, sink_v = tensors[3:5]
        held = min(n0, self.S)  # sinks held before the step
        before = (Segment(EXACT, 0, held, k=sink_k[:, :, :held], v=sink_v[:, :, :held]),) if held else ()
        after = self._ring(ring_k, ring_v, nq, max(n0 - self.S, 0))
        if staged:  # a prompt's tokens, exact; a decode step's token is the last one in the sinks or the ring
            after.append(Segment(EXACT, n0, query_length, is_new=True, k=self.pending[0], v=self.pending[1]))
        elif n0 < self.S:
            after.append(Segment(EXACT, n0, 1, is_new=True, k=sink_k[:, :, n0:n], v=sink_v[:, :, n0:n]))
        else:
            after += self._ring(ring_k, ring_v, n0 - self.S, n - self.S, is_new=True)
        return SegmentPlan(before, stored, tuple(after), self.codecs["k"].fmt, self.codecs["v"].fmt, 0, n0, self.G,
                           self._shared[0], self._shared[1], memo)

    def nbytes(self) -> dict[str, int]:
        """Bytes allocated: the packed parts (all max_len rows) and the ring."""
        out = {"codes": 0, "params": 0, "fp": 0}
        for key, t in self.parts.items():
            side, name = key.split(".", 1)
            out[self.codecs[side].layout()[name].kind] += t.numel() * t.element_size()
        for t in (self.ring_k, self.ring_v, self.sink_k, self.sink_v) if self.allocated else ():
            out["fp"] += t.numel() * t.element_size()
        return out
