"""KVQuant-style: pre-RoPE per-channel keys with static ranges and sparse outliers; per-token values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...artifact import Side
from ...spec import QuantSpec
from ..kvquant import calibrate_kvquant_keys
from .base import PARAM_DTYPES, Method, check_bits, check_exact, clean_name, group_label, option, value_label
from .skvq import SINKS_HELP, WINDOW_HELP, value_quant

KEY_BITS_HELP = "key code bits (default 2)"
VALUE_BITS_HELP = "value bits: 1.5 (ternary), 1, 2, 3, 4, 8 (default: the key bits)"
OUTLIERS_HELP = "KVQuant keys: channels per token and head kept exactly (default 1 = 1/64 of values)"
NUQ_HELP = "KVQuant keys: non-uniform per-layer codebooks"


def check_outliers(outliers: int) -> None:
    if outliers < 0:
        raise ValueError(f"outliers per token must be >= 0, got {outliers}")


def key_label(key_bits: int, outliers: int, nuq: bool) -> str:
    """The pre-RoPE keys' part of an artifact name (kvquant and hybrid)."""
    return f"k{key_bits}pre-o{outliers}" + ("-nuq" if nuq else "")


@dataclass(frozen=True)
class KvquantSettings:
    method: ClassVar[str] = "kvquant"
    key_bits: int = option(2, KEY_BITS_HELP, type=int)
    value_bits: float | None = option(None, VALUE_BITS_HELP, type=float)  # None: as wide as the keys
    value_group: int | None = option(32, "value group size in channels (default 32)", type=int)
    param_dtype: str = option("fp8-e4m3", "dtype of value group scales/zeros (default fp8-e4m3)",
                              choices=PARAM_DTYPES)
    outliers: int = option(1, OUTLIERS_HELP, type=int)
    nuq: bool = option(False, NUQ_HELP)
    window: int = option(128, WINDOW_HELP, type=int)
    sinks: int = option(4, SINKS_HELP, type=int)

    def __post_init__(self) -> None:
        if self.value_bits is None:
            object.__setattr__(self, "value_bits", float(self.key_bits))
        check_bits(self.key_bits, self.value_bits)
        check_outliers(self.outliers)
        check_exact(self.window, self.sinks)

    def value_quant(self) -> QuantSpec:
        return value_quant(self.value_bits, self.value_group, self.param_dtype)

    def key_label(self) -> str:
        return key_label(self.key_bits, self.outliers, self.nuq)

    def name(self, model_name: str) -> str:
        return clean_name([model_name, "kvquant", self.key_label(),
                           f"v{value_label(self.value_bits)}g{group_label(self.value_group)}",
                           self.param_dtype.replace("-e4m3", ""), f"w{self.window}", f"s{self.sinks}"])


def from_activations(acts, s: KvquantSettings, progress: bool = True, facts=None) -> list[dict[str, Side]]:
    keys = calibrate_kvquant_keys(acts, s.key_bits, s.outliers, s.nuq, progress=progress, window=s.window,
                                  sinks=s.sinks)
    return [{"key": k, "value": Side("plain", s.value_quant()) if k.kind != "none" else
             Side("none", QuantSpec(fmt="none"))} for k in keys]


METHOD = Method("kvquant", "KVQuant-style: pre-RoPE per-channel keys with static ranges and sparse outliers; "
                "per-token values", KvquantSettings, from_activations=from_activations, pre_rope=True)
