"""Static-shape KV manager for static-graph engines (ONNX Runtime, NPUs).

A static graph cannot take a growing cache, so its past input is a fixed window of ``S - 1`` tokens, left-padded,
with an attention mask over ``S`` positions (the window plus the token being decoded).  The manager owns the
buffers the engine reads and writes:

* each K and V buffer reserves ``R = ceil(reserve * (S - 1))`` token slots (``reserve`` 2 by default, 1.5 as the
  seed's memory compromise, anything with ``R >= S``);
* the engine's past input is the view ``[start, start + S - 1)`` and its new K/V output is written straight into
  the slot after it, so an append is that write plus ``start += 1``: the left shift is moving a start index;
* when the slot after the window would fall past ``R``, one copy moves the window (the last ``S - 1`` tokens) to
  the front.  With ``R = 2(S - 1)`` that is one copy per ``S - 1`` appended tokens; ``R = S`` is the naive
  manager that shifts the whole window on every token.

Layouts.  ``"token"`` (default) stores a layer's K (or V) as ``[R, B, H, D]``: the window is one contiguous
block for any batch and head count, so ONNX Runtime reads and writes the buffer in place, and the graph
transposes to ``[B, H, S-1, D]`` itself.  ``"head"`` stores ``[B, H, R, D]``, the graph's shape verbatim; its
window is contiguous only when ``B * H == 1``, otherwise the engine needs a staging copy each step (which the
runner counts).  Every (layer, KV head) series lives in its layer's buffer, strided by the head index.

Quantized storage: :class:`StaticKVQuant` holds fixed, calibrated per-channel or per-tensor scale / zero-point.
The graph dequantizes the past codes and emits the new K/V already quantized with the same parameters, so codes
travel from an output to the next step's input byte for byte: the manager never requantizes anything.  The codes
are kvsqueeze's one affine quantizer (``kvsqueeze.quant.affine``, code zero-point domain) and its bit packer
(``kvsqueeze.quant.packing``); the numpy methods wrap those torch functions (zero-copy), and the traced graphs
call the same ones.
"""

from __future__ import annotations

import ctypes
import json
import math
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported where it is used: the ONNX Runtime path imports this module torch-free
    import torch

LAYOUTS = ("token", "head")
ON_FULL = ("stop", "slide")
FORMULA_BITS = (4, 8, 16, 32)


class WindowFullError(ValueError):
    """Appending would push a real token out of the window while ``on_full="stop"``; nothing was changed."""


def _as_fraction(reserve: float) -> Fraction:
    # Fraction(str(x)) keeps 1.5 and 2 exact whatever their binary form, so the seed's figures come out exact.
    return Fraction(str(reserve)) if isinstance(reserve, float) else Fraction(reserve)


def reserved_tokens(max_len: int, reserve: float = 2.0) -> int:
    """Token slots each K/V buffer reserves: ``ceil(reserve * (S - 1))``; at least ``S`` so one token fits after
    the window."""
    _check_positive_int("max_len", max_len, minimum=2)
    r = math.ceil(_as_fraction(reserve) * (max_len - 1))
    if r < max_len:
        raise ValueError(
            f"reserve {reserve} leaves no slot after the {max_len - 1}-token window; use reserve >= "
            f"{max_len}/{max_len - 1} (2 avoids copies until S-1 tokens are appended, 1.5 is the seed's compromise)"
        )
    return r


def static_buffer_bytes(
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    max_len: int,
    reserve: float = 2.0,
    bits: int = 16,
    batch_size: int = 1,
) -> int:
    """Bytes of the shared K/V buffers, the seed's formula:

    ``2 (K and V) * n_layers * n_kv_heads * reserve * (S - 1) * head_dim * bits / 8`` (times the batch).

    ``reserve * (S - 1)`` is taken exactly, as the seed does (1.5 * 2047 tokens is 3070.5); the manager allocates
    the next whole token (:func:`reserved_tokens`), so its ``nbytes`` equals this whenever ``reserve * (S - 1)``
    is a whole number.  Llama-7B (32 layers, 32 heads, D = 128, S = 2048, 16-bit): 2,146,435,072 bytes with
    reserve 2 and 1,609,826,304 with 1.5.
    """
    for name, v in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                    ("batch_size", batch_size)):
        _check_positive_int(name, v)
    _check_positive_int("max_len", max_len, minimum=2)
    if bits not in FORMULA_BITS:
        raise ValueError(f"bits must be one of {', '.join(map(str, FORMULA_BITS))}, got {bits!r}")
    frac = _as_fraction(reserve)
    if frac < 1:
        raise ValueError(f"reserve must be >= 1 (a multiple of the S-1 window), got {reserve!r}")
    total = 2 * n_layers * n_kv_heads * frac * (max_len - 1) * head_dim * bits * batch_size / 8
    return math.ceil(total)


def expected_copies(decode_tokens: int, max_len: int, reserved: int) -> int:
    """Window copies after ``decode_tokens`` one-token appends that follow a prefill (start at 0).

    ``R - (S - 1)`` appends fit after each copy, so the count is ``(n - 1) // (R - S + 1)``: 0 until the reserve
    is used up, then one per ``R - S + 1`` tokens (one per ``S - 1`` tokens with ``R = 2(S - 1)``).
    """
    free = reserved - (max_len - 1)
    if free < 1:
        raise ValueError(f"reserved {reserved} must exceed the window {max_len - 1}")
    return 0 if decode_tokens <= 0 else (decode_tokens - 1) // free


def _check_positive_int(name: str, v: object, minimum: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")


@dataclass
class StaticKVStats:
    """What the manager did to its buffers since construction (``reset`` keeps them)."""

    copies: int = 0  # window-to-front moves (each moves every layer's K and V)
    buffer_copies: int = 0  # individual buffer moves: copies * 2 * n_layers
    bytes_moved: int = 0  # bytes copied by those moves
    bytes_written: int = 0  # bytes the manager itself wrote (append / load); engine writes in place are free
    staging_bytes: int = 0  # bytes copied to or from non-contiguous views for the engine (the "head" layout)
    tokens_appended: int = 0
    requantizations: int = 0  # stored codes are only moved, never requantized; kept to report it explicitly
    copy_ns: int = 0  # wall time spent in those moves

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class StaticKVManager:
    """Fixed-shape K/V buffers shared with a static-graph engine.

    Call order for one decode step: :meth:`prepare` (may do the one copy), hand the engine
    :meth:`window` views, :meth:`attention_mask` and :meth:`position_ids`, let it write the new K/V into
    :meth:`slot` views, then :meth:`commit`.  :meth:`append` does the write for engines that return arrays.
    A prompt is loaded with :meth:`reset` then :meth:`prefill_views` (the engine writes the whole window) and
    :meth:`commit_prefill`, or with :meth:`load_prefill`.
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        batch_size: int = 1,
        reserve: float = 2.0,
        reserved: int | None = None,
        dtype: np.dtype | type = np.float32,
        layout: str = "token",
        on_full: str = "stop",
    ) -> None:
        for name, v in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                        ("batch_size", batch_size)):
            _check_positive_int(name, v)
        _check_positive_int("max_len", max_len, minimum=2)
        if reserved is not None:
            _check_positive_int("reserved", reserved, minimum=max_len)
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; allowed: {', '.join(LAYOUTS)}")
        if on_full not in ON_FULL:
            raise ValueError(f"unknown on_full {on_full!r}; allowed: {', '.join(ON_FULL)}")
        self.window_len = max_len - 1
        self.reserved = reserved_tokens(max_len, reserve) if reserved is None else int(reserved)
        self.max_len, self.n_layers, self.n_kv_heads, self.head_dim = max_len, n_layers, n_kv_heads, head_dim
        self.batch_size, self.layout, self.on_full = batch_size, layout, on_full
        self.dtype = np.dtype(dtype)
        shape = ((self.reserved, batch_size, n_kv_heads, head_dim) if layout == "token"
                 else (batch_size, n_kv_heads, self.reserved, head_dim))
        self.k = [np.zeros(shape, self.dtype) for _ in range(n_layers)]
        self.v = [np.zeros(shape, self.dtype) for _ in range(n_layers)]
        self.token_bytes = batch_size * n_kv_heads * head_dim * self.dtype.itemsize  # one token, one buffer
        self.start = 0
        self.lengths = np.zeros(batch_size, np.int64)  # real tokens committed per row (not capped at S-1)
        self._prepared = 0
        self.stats = StaticKVStats()

    @classmethod
    def naive(cls, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, **kw) -> StaticKVManager:
        """The baseline: ``S`` slots per buffer, so every append after the first shifts the whole window."""
        return cls(n_layers, n_kv_heads, head_dim, max_len, reserved=max_len, **kw)

    # ----------------------------------------------------------------- geometry
    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.k) + sum(b.nbytes for b in self.v)

    @property
    def contiguous(self) -> bool:
        """Whether the engine can read the window and write the slot in place (no staging copy)."""
        return self.layout == "token" or self.batch_size * self.n_kv_heads == 1

    def window_shape(self, tokens: int | None = None) -> tuple[int, int, int, int]:
        t = self.window_len if tokens is None else tokens
        b, h, d = self.batch_size, self.n_kv_heads, self.head_dim
        return (t, b, h, d) if self.layout == "token" else (b, h, t, d)

    def _span(self, buf: np.ndarray, lo: int, hi: int) -> np.ndarray:
        return buf[lo:hi] if self.layout == "token" else buf[:, :, lo:hi]

    def window(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(K, V) views of the engine's past input for ``layer``: the last S-1 tokens, left-padded."""
        s, e = self.start, self.start + self.window_len
        return self._span(self.k[layer], s, e), self._span(self.v[layer], s, e)

    def slot(self, layer: int, n: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(K, V) views of the ``n`` slots after the window, where the engine writes new K/V (after prepare)."""
        if n != self._prepared:
            raise ValueError(f"prepare({n}) must come before slot({n})")
        e = self.start + self.window_len
        return self._span(self.k[layer], e, e + n), self._span(self.v[layer], e, e + n)

    def valid(self) -> np.ndarray:
        """Real tokens in the window per row (the rest of the window is left padding)."""
        return np.minimum(self.lengths, self.window_len)

    def attention_mask(self, new_tokens: int = 1) -> np.ndarray:
        """``[B, S-1 + new_tokens]`` int64: 0 on the left padding, 1 on real past tokens and on the new tokens."""
        w = self.window_len
        pad = (w - self.valid())[:, None]
        mask = np.ones((self.batch_size, w + new_tokens), np.int64)
        mask[:, :w] = np.arange(w)[None, :] >= pad
        return mask

    def position_ids(self, new_tokens: int = 1) -> np.ndarray:
        """``[B, new_tokens]`` int64 absolute positions of the tokens being decoded (they keep growing when the
        window slides, so RoPE distances stay right)."""
        return self.lengths[:, None] + np.arange(new_tokens, dtype=np.int64)[None, :]

    # ----------------------------------------------------------------- state changes
    def reset(self, zero: bool = True) -> None:
        """Forget every token (start over at the front); ``zero`` clears the padding to zeros."""
        if zero:
            for buf in (*self.k, *self.v):
                buf.fill(0)
        self.start = 0
        self.lengths[:] = 0
        self._prepared = 0

    def prepare(self, n: int = 1) -> None:
        """Make room for ``n`` tokens after the window; checks everything before changing anything."""
        _check_positive_int("n", n)
        free = self.reserved - self.window_len
        if n > free:
            raise ValueError(f"cannot append {n} tokens at once: at most {free} fit after the window")
        if self.on_full == "stop" and int(self.lengths.max()) + n > self.window_len:
            raise WindowFullError(
                f"the static window holds {self.window_len} tokens (max length S={self.max_len}) and appending {n} "
                f"more would drop the oldest; stopping (use on_full='slide' to keep going with a sliding window)"
            )
        if self.start + self.window_len + n > self.reserved:
            self._compact()
        self._prepared = n

    def commit(self, n: int = 1) -> None:
        """Take the ``n`` slots the engine just wrote into the window: the left shift is ``start += n``."""
        if n != self._prepared:
            raise ValueError(f"commit({n}) does not match prepare({self._prepared})")
        self.start += n
        self.lengths += n
        self.stats.tokens_appended += n
        self._prepared = 0

    def append(self, k_new: list[np.ndarray], v_new: list[np.ndarray]) -> None:
        """Write one array per layer (shape :meth:`window_shape` with ``n`` tokens) after the window, then commit."""
        n = self._check_arrays(k_new, v_new)
        self.prepare(n)
        for layer in range(self.n_layers):
            ks, vs = self.slot(layer, n)
            ks[...] = k_new[layer]
            vs[...] = v_new[layer]
        self.stats.bytes_written += 2 * self.n_layers * n * self.token_bytes
        self.commit(n)

    def prefill_views(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """After :meth:`reset`, the whole window per layer, for a prefill graph to write its K/V into."""
        if self.start != 0 or self.lengths.any():
            raise ValueError("prefill_views() needs a fresh manager: call reset() first")
        return [self.window(layer) for layer in range(self.n_layers)]

    def commit_prefill(self, lengths: list[int] | np.ndarray) -> None:
        """Record the prompt lengths of the left-padded window the prefill graph wrote."""
        lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if lens.shape != (self.batch_size,):
            raise ValueError(f"expected {self.batch_size} prompt lengths, got {lens.shape[0]}")
        if (lens < 1).any() or (lens > self.window_len).any():
            raise ValueError(f"prompt lengths must be in 1..{self.window_len} (S-1), got {lens.tolist()}")
        if self.start != 0 or self.lengths.any():
            raise ValueError("commit_prefill() needs a fresh manager: call reset() first")
        self.lengths[:] = lens
        self.stats.tokens_appended += int(lens.sum())

    def load_prefill(self, k: list[np.ndarray], v: list[np.ndarray], lengths: list[int] | np.ndarray) -> None:
        """Copy a prefill's left-padded window (one array per layer) in, for engines that return arrays."""
        if self._check_arrays(k, v) != self.window_len:
            raise ValueError(f"prefill arrays must span the {self.window_len}-token window")
        self.reset(zero=False)
        for layer, (kw, vw) in enumerate(self.prefill_views()):
            kw[...] = k[layer]
            vw[...] = v[layer]
        self.stats.bytes_written += 2 * self.n_layers * self.window_len * self.token_bytes
        self.commit_prefill(lengths)

    # ----------------------------------------------------------------- internals
    def _check_arrays(self, k: list[np.ndarray], v: list[np.ndarray]) -> int:
        if len(k) != self.n_layers or len(v) != self.n_layers:
            raise ValueError(f"expected {self.n_layers} K and V arrays, got {len(k)} and {len(v)}")
        first = np.shape(k[0])
        n = first[0] if self.layout == "token" else (first[2] if len(first) == 4 else -1)
        want = self.window_shape(n)
        for a in (*k, *v):
            if np.shape(a) != want:
                raise ValueError(f"K/V arrays must have shape {want} ({self.layout} layout), got {np.shape(a)}")
        return int(n)

    def _compact(self) -> None:
        """Move the window to the front: the one copy.  A single ``memmove`` per buffer (per (row, head) in the
        head layout): overlap-safe, no hidden temporary, so ``bytes_moved`` is what the memory bus really moves."""
        t0 = time.perf_counter_ns()
        w, s = self.window_len, self.start
        for buf in (*self.k, *self.v):
            if self.layout == "token":  # [R, B, H, D]: the window is one contiguous run of bytes
                step = buf.strides[0]
                ctypes.memmove(buf.ctypes.data, buf.ctypes.data + s * step, w * step)
            else:  # [B, H, R, D]: one contiguous run per (row, head)
                step = buf.strides[2]
                for b in range(self.batch_size):
                    for h in range(self.n_kv_heads):
                        base = buf.ctypes.data + b * buf.strides[0] + h * buf.strides[1]
                        ctypes.memmove(base, base + s * step, w * step)
        self.stats.copies += 1
        self.stats.buffer_copies += 2 * self.n_layers
        self.stats.bytes_moved += 2 * self.n_layers * w * self.token_bytes
        self.stats.copy_ns += time.perf_counter_ns() - t0
        self.start = 0


# --------------------------------------------------------------------------- fixed quantization parameters
@dataclass(eq=False)
class StaticKVQuant:
    """Fixed scale / zero-point for K and V, shared by the past inputs and the new outputs of a static graph.

    ``k_scale``/``k_zero``/``v_scale``/``v_zero`` are float32 ``[n_layers, n_kv_heads, head_dim]`` (per channel)
    or ``[n_layers, 1, 1]`` (per tensor).  Codes: 8-bit symmetric -> int8 in [-127, 127] with zero 0; 8-bit
    asymmetric -> uint8 with a zero-point; 4-bit -> two unsigned nibbles per byte (channel ``2i`` in the low
    nibble, ``2i + 1`` in the high one), symmetric ones with zero-point 8.  ``x ~ (q - zero) * scale``.
    """

    bits: int
    symmetric: bool
    granularity: str
    k_scale: np.ndarray
    k_zero: np.ndarray
    v_scale: np.ndarray
    v_zero: np.ndarray
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"static quantization supports bits 4 or 8, got {self.bits!r}")
        if self.granularity not in ("channel", "tensor"):
            raise ValueError(f"granularity must be 'channel' or 'tensor', got {self.granularity!r}")
        for name in ("k_scale", "k_zero", "v_scale", "v_zero"):
            a = np.ascontiguousarray(getattr(self, name), dtype=np.float32)
            if a.ndim != 3 or not np.isfinite(a).all():
                raise ValueError(f"{name} must be a finite [layers, heads, dim] array, got shape {a.shape}")
            setattr(self, name, a)
        if (self.k_scale <= 0).any() or (self.v_scale <= 0).any():
            raise ValueError("scales must be positive")

    # ----- code range
    @property
    def storage_dtype(self) -> np.dtype:
        return np.dtype(np.int8 if (self.bits == 8 and self.symmetric) else np.uint8)

    @property
    def qrange(self) -> tuple[int, int]:
        if self.bits == 8:
            return (-127, 127) if self.symmetric else (0, 255)
        return (1, 15) if self.symmetric else (0, 15)

    @property
    def n_layers(self) -> int:
        return self.k_scale.shape[0]

    def stored_dim(self, head_dim: int) -> int:
        if self.bits == 4 and head_dim % 2:
            raise ValueError(f"4-bit packing needs an even head_dim, got {head_dim}")
        return head_dim if self.bits == 8 else head_dim // 2

    def params(self, kind: str, layer: int) -> tuple[np.ndarray, np.ndarray]:
        if kind not in ("k", "v"):
            raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
        return getattr(self, f"{kind}_scale")[layer], getattr(self, f"{kind}_zero")[layer]

    @classmethod
    def from_ranges(cls, lo_k: np.ndarray, hi_k: np.ndarray, lo_v: np.ndarray, hi_v: np.ndarray, *,
                    bits: int = 8, symmetric: bool = False, granularity: str = "channel",
                    meta: dict | None = None) -> StaticKVQuant:
        """Scale / zero-point from calibrated ranges ([layers, heads, dim] or [layers, 1, 1] each)."""
        def one(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            lo, hi = np.minimum(lo, 0.0), np.maximum(hi, 0.0)  # keep 0 representable (exact padding)
            if symmetric:
                levels = 127 if bits == 8 else 7
                scale = np.maximum(np.maximum(-lo, hi), 1e-8) / levels
                zero = np.zeros_like(scale) if bits == 8 else np.full_like(scale, 8.0)
            else:
                levels = (1 << bits) - 1
                scale = np.maximum(hi - lo, 1e-8) / levels
                zero = np.clip(np.round(-lo / scale), 0, levels)
            return scale.astype(np.float32), zero.astype(np.float32)

        ks, kz = one(np.asarray(lo_k, np.float32), np.asarray(hi_k, np.float32))
        vs, vz = one(np.asarray(lo_v, np.float32), np.asarray(hi_v, np.float32))
        return cls(bits, symmetric, granularity, ks, kz, vs, vz, dict(meta or {}))

    # ----- numpy API over the one quantizer and packer (the traced graph calls the same torch functions)
    def quantize(self, x: np.ndarray, kind: str, layer: int, layout: str = "token") -> np.ndarray:
        """Codes of float ``x`` (token layout ``[T, B, H, D]`` or head layout ``[B, H, T, D]``), in the stored form:
        :func:`~kvsqueeze.quant.affine.affine_codes` (code zero-point domain), 4-bit ones packed by
        :func:`~kvsqueeze.quant.packing.pack_bits` (channel ``2i`` in the low nibble)."""
        scale, zero = self._broadcast(kind, layer, layout)
        return self.codes_torch(_as_tensor(np.asarray(x, np.float32)), _as_tensor(scale), _as_tensor(zero)).numpy()

    def dequantize(self, q: np.ndarray, kind: str, layer: int, layout: str = "token") -> np.ndarray:
        """float32 values of stored codes ``q`` (the inverse layout of :meth:`quantize`)."""
        scale, zero = self._broadcast(kind, layer, layout)
        return self.values_torch(_as_tensor(np.asarray(q, self.storage_dtype)), _as_tensor(scale),
                                 _as_tensor(zero)).numpy()

    def codes_torch(self, x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """Stored codes (int8 / uint8, 4-bit packed) of float tensor ``x``; ``scale``/``zero`` broadcast against
        it.  Traceable: the static graphs quantize their new K/V with it."""
        import torch

        from ..quant.affine import affine_codes
        from ..quant.packing import pack_bits

        lo, hi = self.qrange
        codes = affine_codes(x, scale, zero, lo, hi, domain="code")
        if self.bits == 4:
            return pack_bits(codes.to(torch.uint8), 4)
        return codes.to(torch.int8 if self.storage_dtype.kind == "i" else torch.uint8)

    def values_torch(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """float32 values of stored codes ``q`` (a tensor of :attr:`storage_dtype`).  Traceable: the static graphs
        dequantize their past window with it (4-bit unpacking without a bitwise AND, so opset 17 exports it)."""
        from ..quant.affine import affine_values
        from ..quant.packing import unpack_bits_exportable

        if self.bits == 4:
            q = unpack_bits_exportable(q, 4, 2 * q.shape[-1])
        return affine_values(q, scale, zero, domain="code")

    def _broadcast(self, kind: str, layer: int, layout: str) -> tuple[np.ndarray, np.ndarray]:
        scale, zero = self.params(kind, layer)  # [H, D] or [1, 1]
        if layout == "head":
            return scale[:, None, :], zero[:, None, :]
        return scale, zero

    # ----- persistence
    def save(self, path: str | Path) -> None:
        from ..atomic_dir import staged_file

        path = Path(path) if str(path).endswith(".npz") else Path(f"{path}.npz")  # np.savez's own naming
        with staged_file(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, k_scale=self.k_scale, k_zero=self.k_zero, v_scale=self.v_scale, v_zero=self.v_zero,
                     header=np.array(json.dumps({"bits": self.bits, "symmetric": self.symmetric,
                                                 "granularity": self.granularity, "meta": self.meta})))

    @classmethod
    def load(cls, path: str | Path) -> StaticKVQuant:
        with np.load(Path(path)) as z:
            head = json.loads(str(z["header"]))
            return cls(head["bits"], head["symmetric"], head["granularity"], z["k_scale"], z["k_zero"],
                       z["v_scale"], z["v_zero"], head.get("meta", {}))

    def digest(self) -> str:
        import hashlib

        h = hashlib.sha256(f"{self.bits}{self.symmetric}{self.granularity}".encode())
        for a in (self.k_scale, self.k_zero, self.v_scale, self.v_zero):
            h.update(a.tobytes())
        return h.hexdigest()[:16]


def _as_tensor(a: np.ndarray) -> torch.Tensor:
    """A zero-copy tensor view of ``a`` (a copy only when ``a`` is read-only, which torch cannot wrap)."""
    import torch

    return torch.from_numpy(a if a.flags.writeable else a.copy())


def manager_for(info, dtype, reserve: float = 2.0, on_full: str = "stop", naive: bool = False) -> StaticKVManager:
    """A manager shaped for an engine described by ``info`` (n_layers, n_kv_heads, stored_dim, max_len,
    batch_size, layout); ``naive`` gives the shift-every-token baseline."""
    kw = dict(batch_size=info.batch_size, dtype=dtype, layout=info.layout, on_full=on_full)
    if naive:
        return StaticKVManager.naive(info.n_layers, info.n_kv_heads, info.stored_dim, info.max_len, **kw)
    return StaticKVManager(info.n_layers, info.n_kv_heads, info.stored_dim, info.max_len, reserve=reserve, **kw)


def check_manager_matches(m: StaticKVManager, info, dtype, what: str) -> None:
    """ValueError before the engine runs when a manager does not fit the engine's fixed shapes."""
    got = (m.n_layers, m.n_kv_heads, m.head_dim, m.max_len, m.batch_size, m.layout, m.dtype)
    want = (info.n_layers, info.n_kv_heads, info.stored_dim, info.max_len, info.batch_size, info.layout, dtype)
    if got != want:
        names = "(layers, kv heads, stored dim, S, batch, layout, dtype)"
        raise ValueError(f"the manager {names} = {got} does not match {what}'s {want}")
