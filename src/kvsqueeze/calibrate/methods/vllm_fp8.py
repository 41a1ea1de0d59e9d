"""vLLM's fp8 KV cache: per-layer k_scale/v_scale and compensation of vLLM's truncating fp8 conversion."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...artifact import Side
from ..vllm_fp8 import FP8_FORMATS, ROUNDINGS, calibrate_vllm_fp8
from .base import Method, check_choice, clean_name, option


@dataclass(frozen=True)
class VllmFp8Settings:
    method: ClassVar[str] = "vllm-fp8"
    fp8_format: str = option("e4m3", "the fp8 format vLLM will serve with (--kv-cache-dtype fp8_e4m3 or fp8_e5m2)",
                             choices=FP8_FORMATS)
    rounding: str = option("truncate", "how the serving vLLM converts to fp8 (truncate: its CPU kernels; nearest: "
                           "round-to-nearest-even kernels)", choices=ROUNDINGS)
    compensate: bool = option(True, "scales only, no compensation of the fp8 conversion's bias",
                              flag="--no-compensation", negate=True)
    rotate_keys: bool = option(True, "no RoPE-pair rotations of the keys (folded into W_q/W_k on export)",
                               flag="--no-key-rotation", negate=True)

    def __post_init__(self) -> None:
        check_choice("fp8 format", self.fp8_format, FP8_FORMATS)
        check_choice("rounding", self.rounding, ROUNDINGS)

    def name(self, model_name: str) -> str:
        return clean_name([model_name, "vllm-fp8", self.fp8_format, self.rounding,
                           "comp" if self.compensate else "nocomp", "rot" if self.rotate_keys else "norot"])


def from_activations(acts, s: VllmFp8Settings, progress: bool = True, facts=None) -> list[dict[str, Side]]:
    return calibrate_vllm_fp8(acts, s.fp8_format, s.rounding, s.compensate, s.rotate_keys, progress=progress)


METHOD = Method("vllm-fp8", "vLLM's fp8 KV cache: per-layer k_scale/v_scale from an MSE grid search and per-head "
                "compensation of vLLM's truncating fp8 conversion, for kvsqueeze export --vllm", VllmFp8Settings,
                from_activations=from_activations, keeps_exact=False)
