"""KVQuant-style pre-RoPE keys with SKVQ values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...artifact import Side
from ...spec import QuantSpec
from ..clip import CLIP_MODES
from ..kvquant import calibrate_kvquant_keys
from ..skvq import calibrate_skvq
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
from .kvquant import KEY_BITS_HELP, NUQ_HELP, OUTLIERS_HELP, check_outliers, key_label
from .skvq import SINKS_HELP, WINDOW_HELP, value_quant


@dataclass(frozen=True)
class HybridSettings:
    method: ClassVar[str] = "hybrid"
    key_bits: int = option(2, KEY_BITS_HELP, type=int)
    value_bits: float = option(1.5, "value bits: 1.5 (ternary), 1, 2, 3, 4, 8 (default 1.5)", type=float)
    value_group: int | None = option(32, "value group size in channels (default 32)", type=int)
    param_dtype: str = option("fp8-e4m3", "dtype of value group scales/zeros (default fp8-e4m3)",
                              choices=PARAM_DTYPES)
    reorder: bool = option(True, "SKVQ values without channel reordering (ablation)", flag="--no-reorder",
                           negate=True)
    clip: str = option("layer", "clip-ratio search granularity of the values (default layer)", choices=CLIP_MODES)
    outliers: int = option(1, OUTLIERS_HELP, type=int)
    nuq: bool = option(False, NUQ_HELP)
    window: int = option(128, WINDOW_HELP, type=int)
    sinks: int = option(4, SINKS_HELP, type=int)

    def __post_init__(self) -> None:
        check_choice("clip mode", self.clip, CLIP_MODES)
        check_bits(self.key_bits, self.value_bits)
        check_outliers(self.outliers)
        check_exact(self.window, self.sinks)

    def value_quant(self) -> QuantSpec:
        return value_quant(self.value_bits, self.value_group, self.param_dtype)

    def name(self, model_name: str) -> str:
        return clean_name([model_name, "hybrid", key_label(self.key_bits, self.outliers, self.nuq),
                           f"v{value_label(self.value_bits)}g{group_label(self.value_group)}",
                           self.param_dtype.replace("-e4m3", ""), "reorder" if self.reorder else "noreorder",
                           f"clip-{self.clip}", f"w{self.window}", f"s{self.sinks}"])


def from_activations(acts, s: HybridSettings, progress: bool = True, facts=None) -> list[dict[str, Side]]:
    ws = {"window": s.window, "sinks": s.sinks}
    unused = QuantSpec(fmt="none")  # keys come from the pre-RoPE calibration below
    layers = calibrate_skvq(acts, unused, s.value_quant(), s.reorder, s.clip, progress=progress, sides=("value",),
                            **ws)
    keys = calibrate_kvquant_keys(acts, s.key_bits, s.outliers, s.nuq, progress=progress, **ws)
    for lay, k in zip(layers, keys):
        lay["key"] = k
    return layers


METHOD = Method("hybrid", "KVQuant-style keys with SKVQ values", HybridSettings, from_activations=from_activations,
                pre_rope=True)
