"""SKVQ: reordered per-token groups, searched clip ratios, fp8 group parameters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...spec import QuantSpec
from ..clip import CLIP_MODES
from ..skvq import calibrate_skvq, side_quant
from .base import (
    PARAM_DTYPES,
    Method,
    check_bits,
    check_choice,
    check_exact,
    clean_name,
    group_label,
    option,
    value_label,
)

WINDOW_HELP = "full-precision window of the artifact (default 128)"
SINKS_HELP = "full-precision sink tokens (default 4)"


def value_quant(value_bits: float, value_group: int | None, param_dtype: str) -> QuantSpec:
    if value_bits == 1.5:
        return side_quant("ternary", 2, value_group, param_dtype)
    return side_quant("int", int(value_bits), value_group, param_dtype)


@dataclass(frozen=True)
class SkvqSettings:
    method: ClassVar[str] = "skvq"
    key_bits: int = option(2, "key code bits (default 2)", type=int)
    value_bits: float = option(1.5, "value bits: 1.5 (ternary, docs/calibrated.md), 1, 2, 3, 4, 8 (default 1.5)",
                               type=float)
    key_group: int | None = option(32, "key group size in channels (default 32)", type=int)
    value_group: int | None = option(32, "value group size in channels (default 32)", type=int)
    param_dtype: str = option("fp8-e4m3", "dtype of group scales/zeros (default fp8-e4m3 as SKVQ)",
                              choices=PARAM_DTYPES)
    reorder: bool = option(True, "SKVQ without channel reordering (ablation)", flag="--no-reorder", negate=True)
    clip: str = option("layer", "clip-ratio search granularity (default layer; none = plain RTN ranges)",
                       choices=CLIP_MODES)
    window: int = option(128, WINDOW_HELP, type=int)
    sinks: int = option(4, SINKS_HELP, type=int)

    def __post_init__(self) -> None:
        check_choice("clip mode", self.clip, CLIP_MODES)
        check_bits(self.key_bits, self.value_bits)
        check_exact(self.window, self.sinks)

    def key_quant(self) -> QuantSpec:
        return side_quant("int", self.key_bits, self.key_group, self.param_dtype)

    def value_quant(self) -> QuantSpec:
        return value_quant(self.value_bits, self.value_group, self.param_dtype)

    def name(self, model_name: str) -> str:
        return clean_name([model_name, "skvq", f"k{self.key_bits}g{group_label(self.key_group)}",
                           f"v{value_label(self.value_bits)}g{group_label(self.value_group)}",
                           self.param_dtype.replace("-e4m3", ""), "reorder" if self.reorder else "noreorder",
                           f"clip-{self.clip}", f"w{self.window}", f"s{self.sinks}"])


def from_activations(acts, s: SkvqSettings, progress: bool = True, facts=None):
    return calibrate_skvq(acts, s.key_quant(), s.value_quant(), s.reorder, s.clip, progress=progress,
                          window=s.window, sinks=s.sinks)


METHOD = Method("skvq", "SKVQ: reordered per-token groups, searched clip ratios, fp8 group parameters",
                SkvqSettings, from_activations=from_activations)
