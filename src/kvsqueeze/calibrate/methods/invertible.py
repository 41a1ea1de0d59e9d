"""Learned invertible key/value transforms folded into the attention weights (docs/transforms.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ...artifact import Side
from ..invertible import (
    GROUPING_DEFAULTS,
    GROUPINGS,
    TRANSFORM_HELP,
    TRANSFORMS,
    LearnSettings,
    calibrate_invertible,
    grouping_quants,
)
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
from .skvq import SINKS_HELP, WINDOW_HELP


@dataclass(frozen=True)
class InvertibleSettings:
    """Defaults: 4-bit per-token groups of 64 with fp16 parameters (``--grouping token``); the command line takes
    the group sizes and parameter dtype of the chosen grouping (``GROUPING_DEFAULTS``) when they are not given."""

    method: ClassVar[str] = "invertible"
    transform: str = option("learned-folded", "; ".join(f"{k}: {v}" for k, v in TRANSFORM_HELP.items()),
                            choices=list(TRANSFORM_HELP))
    grouping: str = option("token", "the quantizer behind the transform - per-token groups (default), kivi "
                           "(per-channel keys, per-token values) or skvq (reorder + clip search)", choices=GROUPINGS)
    key_bits: int = option(4, "key code bits (default 4)", type=int)
    value_bits: float | None = option(None, "value bits (default: the key bits; 1.5 needs --grouping skvq)",
                                      type=float)
    key_group: int | None = option(64, "key group size (default 64 for --grouping token, in tokens for kivi)",
                                   type=int)
    value_group: int | None = option(64, "value group size in channels (default 64 for --grouping token)", type=int)
    param_dtype: str = option("fp16", "dtype of group scales/zeros (default fp16; fp8-e4m3 for --grouping skvq)",
                              choices=PARAM_DTYPES)
    steps: int = option(150, "Adam steps per layer (default 150)", type=int)
    rank: int = option(8, "rank of the Woodbury updates (default 8)", type=int)
    seed: int = option(0, "seed of the initialisation (and of --generated sampling; default 0)", type=int)
    window: int = option(128, WINDOW_HELP, type=int)
    sinks: int = option(4, SINKS_HELP, type=int)

    def __post_init__(self) -> None:
        if self.value_bits is None:
            object.__setattr__(self, "value_bits", float(self.key_bits))
        check_bits(self.key_bits, self.value_bits)
        check_exact(self.window, self.sinks)
        check_choice("transform", self.transform, TRANSFORMS)
        check_choice("grouping", self.grouping, GROUPINGS)
        if self.steps < 0 or self.rank < 0:
            raise ValueError(f"--steps and --rank must be non-negative, got {self.steps} and {self.rank}")
        if self.value_bits == 1.5 and self.grouping != "skvq":
            raise ValueError("1.5-bit (ternary) values need --grouping skvq")

    def name(self, model_name: str) -> str:
        return clean_name([model_name, "invertible", self.transform, self.grouping,
                           f"k{self.key_bits}g{group_label(self.key_group)}",
                           f"v{value_label(self.value_bits)}g{group_label(self.value_group)}",
                           self.param_dtype.replace("-e4m3", ""), f"w{self.window}", f"s{self.sinks}"])


def from_activations(acts, s: InvertibleSettings, progress: bool = True, facts=None) -> list[dict[str, Side]]:
    kq, vq = grouping_quants(s.grouping, s.key_bits, s.value_bits, s.key_group, s.value_group, s.param_dtype)
    shared = facts is not None and facts.qk_norm == "per-head"  # a diagonal key transform folds into the norm
    return calibrate_invertible(acts, s.transform, s.grouping, kq, vq, LearnSettings(steps=s.steps, rank=s.rank,
                                                                                      seed=s.seed),
                                progress=progress, shared_key_scales=shared, window=s.window, sinks=s.sinks)


def grouping_defaults(given: dict[str, Any]) -> dict[str, Any]:
    """Command-line defaults: the group sizes and parameter dtype of the chosen grouping."""
    return dict(GROUPING_DEFAULTS.get(given.get("grouping", "token"), GROUPING_DEFAULTS["token"]))


METHOD = Method("invertible", "learned invertible key/value transforms (keys RoPE-commuting or online) folded into "
                "the attention weights, with a per-token, KIVI or SKVQ grouping", InvertibleSettings,
                from_activations=from_activations, cli_defaults=grouping_defaults)
