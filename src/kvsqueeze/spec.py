"""Frozen descriptions of how keys and values are stored, and the named presets.

A :class:`QuantSpec` says how one tensor kind (keys or values) is quantized; a :class:`CacheSpec` pairs a key
spec with a value spec and adds the full-precision window and the attention-sink tokens.  Everything is
validated when the object is built, so a bad setting fails before any cache memory is allocated.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import CacheSpecError

INT_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
PACKABLE_BITS = (1, 2, 3, 4, 8)  # bit widths with a dense uint8 packing; others are stored one code per byte
ROT_FORMATS = ("rot", "rot-qjl")  # rotated codebook formats (docs/rotated.md); bits may be fractional
FORMATS = ("none", "int", "fp8-e4m3", "fp8-e5m2", "ternary") + ROT_FORMATS
AXES = ("token", "channel")
PARAM_DTYPES = ("fp32", "fp16", "bf16", "fp8-e4m3")
FP8_SCALES = ("tensor", "head", "token")


@dataclass(frozen=True)
class QuantSpec:
    """How one of keys or values is stored.

    fmt:          "int" (integer codes), "fp8-e4m3" / "fp8-e5m2" (scaled float8), or "none" (full precision).
    bits:         1-8 for "int"; ignored otherwise.
    axis:         "token"  - parameters per token, a group spans ``group`` consecutive channels of one token
                             (transformers' layout, KIVI's values);
                  "channel" - parameters per channel, a group spans ``group`` consecutive tokens of one channel
                             (KIVI's keys).  Tokens are then quantized ``group`` at a time.
    group:        group size along the grouped axis; ``None`` means the whole head_dim for axis="token".
                  Required for axis="channel".
    symmetric:    absmax (codes centred on zero, no zero-point stored) instead of min/max with a zero-point.
    clip:         clipping ratio alpha in (0, 1]: the range used is alpha times the group's range (SKVQ).
    param_dtype:  storage dtype of scales and zero-points ("fp8-e4m3" as SKVQ does).
    fp8_scale:    for fp8 formats, scale granularity: per "tensor" (one per layer), "head" or "token".
    "rot" / "rot-qjl": a fixed random rotation, one Lloyd-Max codebook per coordinate and the vector's L2 norm
                  (in ``param_dtype``) per token and head (docs/rotated.md); ``bits`` in [1, 4], fractional ones
                  (2.75, 3.25, ...) mixing two widths across rotated coordinates; "rot-qjl" adds a 1-bit sign
                  sketch of the residual and its norm.  Per token (axis "token", no group), or for "rot" centred:
                  axis "channel", group G - the per-channel mean of each G-token group (rotated space, in
                  ``param_dtype``) is subtracted before coding and stored once per group.
    extras:       calibrated tensors of one layer (channel permutation, per-group clip ratios, pre-RoPE
                  per-channel parameters...), set by :mod:`kvsqueeze.calibrate` artifacts; ``None`` for every
                  preset.  "ternary" (the 1.5-bit format of docs/calibrated.md) is per-token only.
    """

    fmt: str = "int"
    bits: int = 8
    axis: str = "token"
    group: int | None = None
    symmetric: bool = False
    clip: float = 1.0
    param_dtype: str = "fp16"
    fp8_scale: str = "token"
    extras: Any = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown format {self.fmt!r}; allowed: {', '.join(FORMATS)}")
        if self.fmt in ROT_FORMATS:
            if isinstance(self.bits, bool) or not isinstance(self.bits, int | float) or not 1 <= self.bits <= 4:
                raise ValueError(f"{self.fmt} bits must be a number in [1, 4] (e.g. 3 or 2.75), got {self.bits!r}")
            centred = self.fmt == "rot" and self.axis == "channel" and isinstance(self.group, int) \
                and not isinstance(self.group, bool) and self.group >= 1
            if (self.axis, self.group) != ("token", None) and not centred:
                raise ValueError(f"the {self.fmt} format is per token over the whole head (axis='token', "
                                 "group=None); 'rot' may also be centred by per-channel means over token groups "
                                 "(axis='channel', group=G >= 1)")
        if self.fmt == "int" and self.bits not in INT_BITS:
            raise ValueError(f"unsupported bits {self.bits!r}; allowed: {', '.join(map(str, INT_BITS))}")
        if self.axis not in AXES:
            raise ValueError(f"unknown axis {self.axis!r}; allowed: {', '.join(AXES)}")
        if self.group is not None and (not isinstance(self.group, int) or self.group < 1):
            raise ValueError(f"group size must be a positive integer or None, got {self.group!r}")
        if self.fmt == "int" and self.axis == "channel" and self.group is None:
            raise ValueError("axis='channel' needs a token group size (e.g. group=32, as KIVI uses)")
        if not (0.0 < self.clip <= 1.0):
            raise ValueError(f"clip ratio must be in (0, 1], got {self.clip!r}")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"unknown param_dtype {self.param_dtype!r}; allowed: {', '.join(PARAM_DTYPES)}")
        if self.fp8_scale not in FP8_SCALES:
            raise ValueError(f"unknown fp8_scale {self.fp8_scale!r}; allowed: {', '.join(FP8_SCALES)}")
        if self.fmt == "ternary" and self.axis != "token":
            raise ValueError("the ternary (1.5-bit) format stores per-token groups only; use axis='token'")

    @property
    def quantized(self) -> bool:
        return self.fmt != "none"

    @property
    def token_group(self) -> int:
        """How many tokens must be present before they can be quantized together (1 for per-token layouts)."""
        return self.group if (self.fmt in ("int",) + ROT_FORMATS and self.axis == "channel") else 1

    def channel_group(self, head_dim: int) -> int:
        """Channels sharing one scale (per-token layout), checked against head_dim."""
        g = head_dim if self.group is None else self.group
        if head_dim % g:
            raise CacheSpecError(f"group size {g} does not divide head_dim {head_dim}; use a divisor of {head_dim}")
        return g

    def check_head_dim(self, head_dim: int) -> None:
        """Raise CacheSpecError (a ValueError) when this spec cannot store vectors of ``head_dim`` channels."""
        if self.fmt == "int":
            if self.axis == "token":
                self.channel_group(head_dim)
            if self.bits == 3 and head_dim % 8:
                raise CacheSpecError(f"3-bit codes are packed 8 per 3 bytes; head_dim {head_dim} is not a multiple of 8")
            if self.bits in (1, 2, 4) and head_dim % (8 // self.bits):
                raise CacheSpecError(f"{self.bits}-bit packing needs head_dim divisible by {8 // self.bits}")
        if self.fmt in ROT_FORMATS:  # the rule of kvsqueeze.quant.codebook.split_bits (which builds the split)
            n_hi = (self.bits - int(self.bits)) * head_dim
            if head_dim < 8 or head_dim & (head_dim - 1):
                raise CacheSpecError(f"the {self.fmt} format needs a power-of-two head_dim >= 8, got {head_dim}")
            if abs(n_hi - round(n_hi)) > 1e-9 or round(n_hi) % 8:
                raise CacheSpecError(f"{self.bits} bits cannot be split over head_dim {head_dim}: use a multiple of "
                                 f"{8 / head_dim:g} bits (8 rotated coordinates at one more bit)")

    def label(self) -> str:
        if self.extras is not None and hasattr(self.extras, "label"):
            return self.extras.label(self)
        if self.fmt == "none":
            return "fp"
        if self.fmt in ROT_FORMATS:
            centre = f"/mean{self.group}" if self.axis == "channel" else ""
            return f"{self.fmt}{self.bits:g}{centre}/{self.param_dtype}"
        if self.fmt == "ternary":
            g = "all" if self.group is None else str(self.group)
            clip = "" if self.clip == 1.0 else f"c{self.clip:g}"
            return f"ternary/token{g}{clip}/{self.param_dtype}"
        if self.fmt != "int":
            return f"{self.fmt}/{self.fp8_scale}"
        g = "all" if self.group is None else str(self.group)
        sym = "s" if self.symmetric else "a"
        clip = "" if self.clip == 1.0 else f"c{self.clip:g}"
        return f"int{self.bits}{sym}/{self.axis}{g}{clip}/{self.param_dtype}"


FULL = QuantSpec(fmt="none")

# Prompt tokens per forward pass wherever kvsqueeze fills a cache (0 = the whole prompt in one pass).  Chunks bound
# what a long prompt holds in full precision (one layer's chunk of K/V) and the transient activations.
DEFAULT_PREFILL_CHUNK = 512


def check_prefill_chunk(chunk: int, max_positions: int | None = None) -> int:
    """``chunk`` if usable: 0 (one pass) or a positive count no larger than the model's positions."""
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
        raise ValueError(f"the prefill chunk must be 0 (the whole prompt in one pass) or a positive number of "
                         f"tokens, got {chunk!r}")
    if max_positions is not None and chunk > max_positions:
        raise ValueError(f"the prefill chunk {chunk} is larger than the model's context ({max_positions} "
                         f"positions); use 0 (one pass) or at most {max_positions}")
    return chunk


def _plain(q: QuantSpec) -> QuantSpec:
    return dataclasses.replace(q, extras=None) if q.extras is not None else q


@dataclass(frozen=True)
class CacheSpec:
    """Key spec, value spec, the full-precision window of recent tokens and the attention sinks.

    window:  at least this many of the most recent tokens stay in full precision.  Tokens are moved out of the
             window ``flush_tokens`` at a time (the key token-group for per-channel keys), so the window holds
             between ``window`` and ``window + flush_tokens - 1`` tokens once the cache is long enough.
    sinks:   the first ``sinks`` tokens are never quantized (attention sinks).
    quantize_sliding: whether sliding-window layers are quantized too (they are bounded, so default False).
    block_tokens: storage grows by preallocated blocks of this many tokens (a multiple of flush_tokens).
    """

    key: QuantSpec = FULL
    value: QuantSpec = FULL
    window: int = 0
    sinks: int = 0
    quantize_sliding: bool = False
    block_tokens: int = 256
    name: str = "custom"
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    # calibrated artifacts: one (key, value) QuantSpec per model layer, used instead of key/value by the cache;
    # window, sinks and block size still come from this spec (so protocols can replace them)
    layer_overrides: tuple[tuple[QuantSpec, QuantSpec], ...] | None = field(
        default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        for what, v in (("window", self.window), ("sinks", self.sinks)):
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{what} must be a non-negative integer, got {v!r}")
        f = self.flush_tokens
        if self.window % f:
            raise ValueError(
                f"window {self.window} is not a multiple of the key/value token group {f}; "
                f"use one of {', '.join(str(f * k) for k in range(0, 5))}, ..."
            )
        if self.block_tokens < 1 or self.block_tokens % f:
            b = self.block_tokens
            fits = ", ".join(str(d) for d in range(1, b + 1) if b % d == 0) if b >= 1 else "none"
            raise ValueError(f"block_tokens {b} must be a positive multiple of the key/value token group {f}; "
                             f"token groups that fit {b}-token blocks: {fits}")
        if self.key.token_group > 1 and self.value.token_group > 1 and self.key.token_group != self.value.token_group:
            raise ValueError("keys and values grouped along tokens must use the same token group size")

    @property
    def flush_tokens(self) -> int:
        """Tokens leave the window this many at a time (and are quantized exactly once, together)."""
        return max(self.key.token_group, self.value.token_group)

    @property
    def quantized(self) -> bool:
        return self.key.quantized or self.value.quantized

    def quantized_count(self, n_tokens: int) -> int:
        """How many tokens (after the sinks) are stored quantized once ``n_tokens`` tokens have been committed.

        The same formula holds whether tokens came in one prefill or one at a time, which is what makes the
        cache deterministic and lets perplexity protocols reproduce it exactly.
        """
        if not self.quantized:
            return 0
        f = self.flush_tokens
        return max(0, n_tokens - self.sinks - self.window) // f * f

    def check_head_dim(self, head_dim: int) -> None:
        """A spec that parses but does not fit a model's heads is refused as a CacheSpecError naming the side."""
        for side, q in (("keys", self.key), ("values", self.value)):
            try:
                q.check_head_dim(head_dim)
            except CacheSpecError as exc:
                raise CacheSpecError(f"cache {self.name!r} does not fit this model: {side}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        # tensors of calibrated specs are not JSON: they are summarised (the artifact directory holds them)
        plain = dataclasses.replace(self, layer_overrides=None, key=_plain(self.key), value=_plain(self.value))
        d = dataclasses.asdict(plain)
        for side, q in (("key", self.key), ("value", self.value)):
            d[side].pop("extras", None)
            if q.extras is not None and hasattr(q.extras, "describe"):
                d[side]["calibrated"] = q.extras.describe()
        d.pop("layer_overrides", None)
        if self.layer_overrides is not None:
            d["calibrated_layers"] = len(self.layer_overrides)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CacheSpec:
        d = dict(d)
        d.pop("layer_overrides", None)
        d.pop("calibrated_layers", None)
        d["key"] = QuantSpec(**{k: v for k, v in d.get("key", {}).items() if k not in ("extras", "calibrated")})
        d["value"] = QuantSpec(**{k: v for k, v in d.get("value", {}).items() if k not in ("extras", "calibrated")})
        return cls(**d)

    def label(self) -> str:
        extra = f" window={self.window} sinks={self.sinks}" if (self.window or self.sinks) else ""
        return f"K[{self.key.label()}] V[{self.value.label()}]{extra}"


def _kivi(bits: int, window: int = 128, sinks: int = 0, name: str = "") -> CacheSpec:
    return CacheSpec(
        key=QuantSpec(fmt="int", bits=bits, axis="channel", group=32),
        value=QuantSpec(fmt="int", bits=bits, axis="token", group=32),
        window=window,
        sinks=sinks,
        name=name or f"kivi-{bits}",
    )


def _per_token(bits: int, group: int = 64, window: int = 128, name: str = "") -> CacheSpec:
    q = QuantSpec(fmt="int", bits=bits, axis="token", group=group)
    return CacheSpec(key=q, value=q, window=window, name=name or f"int{bits}")


def _fp8(fmt: str, name: str) -> CacheSpec:
    q = QuantSpec(fmt=fmt, fp8_scale="token")
    return CacheSpec(key=q, value=q, window=0, name=name)


def _rot(key_bits: float, value_bits: float, name: str, window: int = 128, sinks: int = 4,
         key_group: int = 128) -> CacheSpec:
    """Rotated codebook keys centred over ``key_group``-token groups, plain rotated values."""
    return CacheSpec(key=QuantSpec(fmt="rot", bits=key_bits, axis="channel", group=key_group),
                     value=QuantSpec(fmt="rot", bits=value_bits), window=window, sinks=sinks, name=name)


PRESETS: dict[str, CacheSpec] = {
    "full": CacheSpec(name="full"),
    "int8": _per_token(8, group=64, window=0, name="int8"),
    "fp8-e4m3": _fp8("fp8-e4m3", "fp8-e4m3"),
    "fp8-e5m2": _fp8("fp8-e5m2", "fp8-e5m2"),
    # transformers' QuantizedCache layout: both per-token, groups of 64, residual window 128
    "int4": _per_token(4, name="int4"),
    "int2": _per_token(2, name="int2"),
    "kivi-4": _kivi(4),
    "kivi-3": _kivi(3),
    "kivi-2": _kivi(2),
    "kivi-4-sink4": _kivi(4, sinks=4, name="kivi-4-sink4"),
    "kivi-3-sink4": _kivi(3, sinks=4, name="kivi-3-sink4"),
    "kivi-2-sink4": _kivi(2, sinks=4, name="kivi-2-sink4"),
    # rotated codebooks (docs/rotated.md): keys take more of the budget (their errors cost more attention
    # quality) and are centred by a per-channel mean per 128 tokens; one fp16 scale per 64 channels (+0.25), one
    # fp16 mean per 128 tokens (+0.125): K 2.875 + 0.375 / V 2.5 + 0.25 = 3.0 bits, K 3.875 + 0.375 / V 2.75 = 3.5
    "rot-3": _rot(2.875, 2.5, "rot-3"),
    "rot-3.5": _rot(3.875, 2.5, "rot-3.5"),
}

# one side: integer "<bits><t|c>[group]" or rotated codebook "<bits>r" / "<bits>rq" (bits may be fractional),
# "<bits>rc<G>" centred by per-channel means of G-token groups
_SIDE = (r"(?:(?P<{p}b>\d)(?P<{p}ax>[tc])(?P<{p}g>\d+)?"
         r"|(?P<{p}rb>\d(?:\.\d+)?)(?P<{p}rot>rq|r)(?:c(?P<{p}rg>\d+))?)")
_SPEC_RE = re.compile("^k" + _SIDE.format(p="k") + "-v" + _SIDE.format(p="v")
                      + r"(?:-w(?P<w>\d+))?(?:-s(?P<s>\d+))?\Z", re.ASCII)  # no trailing newline, ASCII digits


def preset(name: str | CacheSpec | dict) -> CacheSpec:
    """Return the :class:`CacheSpec` for a preset name, a spec string, a dict or a CacheSpec.

    Spec strings describe anything not in the table: ``k2c32-v2t32-w128-s4`` means 2-bit keys per channel over
    32-token groups, 2-bit values per token in 32-channel groups, a 128-token window and 4 sinks.  A side may
    also be a rotated codebook format: ``k3r-v2.5r-w128-s4`` (3-bit rotated keys, 2.5-bit rotated values), ``rq``
    for ``rot-qjl`` (``k2rq-...``), ``rc<G>`` for rotated codes centred by the per-channel means of G-token groups
    (``k2.875rc128-...``).  A JSON object
    (string starting with ``{``) is read with :meth:`CacheSpec.from_dict`.
    """
    if isinstance(name, CacheSpec):
        return name
    if isinstance(name, dict):
        return CacheSpec.from_dict(name)
    if not isinstance(name, str):
        raise ValueError(f"a preset is a name, a spec string or a CacheSpec, not {type(name).__name__}")
    if name in PRESETS:
        return PRESETS[name]
    if name.lstrip().startswith("{"):
        return CacheSpec.from_dict(json.loads(name))
    m = _SPEC_RE.match(name)
    if m:
        def side(p: str) -> QuantSpec:
            if m[p + "rot"]:
                b = float(m[p + "rb"])
                centre = {"axis": "channel", "group": int(m[p + "rg"])} if m[p + "rg"] else {}
                return QuantSpec(fmt="rot-qjl" if m[p + "rot"] == "rq" else "rot", bits=int(b) if b == int(b) else b,
                                 **centre)
            return QuantSpec(fmt="int", bits=int(m[p + "b"]), axis="channel" if m[p + "ax"] == "c" else "token",
                             group=int(m[p + "g"]) if m[p + "g"] else None)

        return CacheSpec(
            key=side("k"),
            value=side("v"),
            window=int(m["w"] or 0),
            sinks=int(m["s"] or 0),
            name=name,
        )
    raise ValueError(
        f"unknown preset {name!r}; allowed: {', '.join(PRESETS)}, or a spec string like 'k2c32-v2t32-w128-s4'"
    )
