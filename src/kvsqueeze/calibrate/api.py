"""One entry point for every calibrated method: collect activations, calibrate each side, build the artifact."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from ..artifact import Artifact, Side
from ..layout import AttentionFacts
from ..rope import distinct_tables
from ..spec import QuantSpec
from .clip import CLIP_MODES
from .collect import Activations, CalibrationData, collect
from .invertible import (
    GROUPING_DEFAULTS,
    GROUPINGS,
    TRANSFORMS,
    LearnSettings,
    calibrate_invertible,
    grouping_quants,
)
from .kvquant import calibrate_kvquant_keys
from .requirements import check_model
from .skvq import calibrate_skvq, side_quant
from .vllm_fp8 import FP8_FORMATS, ROUNDINGS, calibrate_vllm_fp8

METHODS = ("skvq", "kvquant", "hybrid", "invertible", "vllm-fp8")
PRE_ROPE_METHODS = ("kvquant", "hybrid")  # keys stored before RoPE: activations un-rotated at collection
METHOD_HELP = {"skvq": "SKVQ: reordered per-token groups, searched clip ratios, fp8 group parameters",
               "kvquant": "KVQuant-style: pre-RoPE per-channel keys with static ranges and sparse outliers; "
                          "per-token values",
               "hybrid": "KVQuant-style keys with SKVQ values",
               "invertible": "learned invertible key/value transforms (keys RoPE-commuting or online) folded into "
                             "the attention weights, with a per-token, KIVI or SKVQ grouping",
               "vllm-fp8": "vLLM's fp8 KV cache: per-layer k_scale/v_scale from an MSE grid search and per-head "
                           "compensation of vLLM's truncating fp8 conversion, for kvsqueeze export --vllm"}


@dataclass(frozen=True)
class CalibrationSettings:
    method: str = "skvq"
    key_bits: int = 2
    value_bits: float = 1.5  # 1.5 = the ternary format (docs/calibrated.md)
    key_group: int | None = 32
    value_group: int | None = 32
    param_dtype: str = "fp8-e4m3"  # of SKVQ groups and plain per-token values
    reorder: bool = True
    clip: str = "layer"
    outliers: int = 1
    nuq: bool = False
    window: int = 128
    sinks: int = 4
    transform: str = "learned-folded"  # invertible method only
    grouping: str = "token"  # invertible method only
    steps: int = 150
    rank: int = 8
    seed: int = 0
    fp8_format: str = "e4m3"  # vllm-fp8 only
    rounding: str = "truncate"  # vllm-fp8 only: the conversion of the vLLM kernels served (CPU: truncate)
    compensate: bool = True  # vllm-fp8 only
    rotate_keys: bool = True  # vllm-fp8 only: RoPE-pair rotations of the keys, folded on export

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; allowed: {', '.join(METHODS)}")
        if self.clip not in CLIP_MODES:
            raise ValueError(f"unknown clip mode {self.clip!r}; allowed: {', '.join(CLIP_MODES)}")
        if self.key_bits not in (1, 2, 3, 4, 8):
            raise ValueError(f"unsupported key bits {self.key_bits}; allowed: 1, 2, 3, 4, 8")
        if self.value_bits not in (1.5, 1, 2, 3, 4, 8):
            raise ValueError(f"unsupported value bits {self.value_bits}; allowed: 1.5 (ternary), 1, 2, 3, 4, 8")
        if self.outliers < 0:
            raise ValueError(f"outliers per token must be >= 0, got {self.outliers}")
        if self.window < 0 or self.sinks < 0:
            raise ValueError("window and sinks must be non-negative")
        if self.transform not in TRANSFORMS:
            raise ValueError(f"unknown transform {self.transform!r}; allowed: {', '.join(TRANSFORMS)}")
        if self.grouping not in GROUPINGS:
            raise ValueError(f"unknown grouping {self.grouping!r}; allowed: {', '.join(GROUPINGS)}")
        if self.steps < 0 or self.rank < 0:
            raise ValueError(f"--steps and --rank must be non-negative, got {self.steps} and {self.rank}")
        if self.fp8_format not in FP8_FORMATS:
            raise ValueError(f"unknown fp8 format {self.fp8_format!r}; allowed: {', '.join(FP8_FORMATS)}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"unknown rounding {self.rounding!r}; allowed: {', '.join(ROUNDINGS)}")
        if self.method == "invertible" and self.value_bits == 1.5 and self.grouping != "skvq":
            raise ValueError("1.5-bit (ternary) values need --grouping skvq")

    def value_quant(self) -> QuantSpec:
        if self.value_bits == 1.5:
            return side_quant("ternary", 2, self.value_group, self.param_dtype)
        return side_quant("int", int(self.value_bits), self.value_group, self.param_dtype)

    def key_quant(self) -> QuantSpec:
        return side_quant("int", self.key_bits, self.key_group, self.param_dtype)

    def name(self, model_name: str) -> str:
        def g(x: int | None) -> str:
            return "all" if x is None else str(x)

        vb = "1.5" if self.value_bits == 1.5 else str(int(self.value_bits))
        if self.method == "vllm-fp8":
            parts = [model_name, "vllm-fp8", self.fp8_format, self.rounding, "comp" if self.compensate else "nocomp",
                     "rot" if self.rotate_keys else "norot"]
            return re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join(parts))
        if self.method == "invertible":
            parts = [model_name, "invertible", self.transform, self.grouping, f"k{self.key_bits}g{g(self.key_group)}",
                     f"v{vb}g{g(self.value_group)}", self.param_dtype.replace("-e4m3", ""), f"w{self.window}",
                     f"s{self.sinks}"]
            return re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join(parts))
        if self.method == "skvq":
            k = f"k{self.key_bits}g{g(self.key_group)}"
        else:
            k = f"k{self.key_bits}pre-o{self.outliers}" + ("-nuq" if self.nuq else "")
        v = f"v{vb}g{g(self.value_group)}"
        parts = [model_name, self.method, k, v, self.param_dtype.replace("-e4m3", "")]
        if self.method != "kvquant":
            parts += ["reorder" if self.reorder else "noreorder", f"clip-{self.clip}"]
        parts += [f"w{self.window}", f"s{self.sinks}"]
        return re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join(parts))


def calibrate_activations(acts: Activations, settings: CalibrationSettings, progress: bool = True,
                          facts: AttentionFacts | None = None) -> list[dict[str, Side]]:
    """Calibrate every layer from collected activations; ``facts`` (:func:`kvsqueeze.layout.attention_facts`)
    adapt the method to the model (shared key scales where a per-head q/k norm takes the fold)."""
    s = settings
    ws = {"window": s.window, "sinks": s.sinks}  # the objective sees what the cache will keep exact
    if s.method == "vllm-fp8":
        return calibrate_vllm_fp8(acts, s.fp8_format, s.rounding, s.compensate, s.rotate_keys, progress=progress)
    if s.method == "invertible":
        kq, vq = grouping_quants(s.grouping, s.key_bits, s.value_bits, s.key_group, s.value_group, s.param_dtype)
        shared = facts is not None and facts.qk_norm == "per-head"
        return calibrate_invertible(acts, s.transform, s.grouping, kq, vq, LearnSettings(steps=s.steps, rank=s.rank,
                                                                                          seed=s.seed),
                                    progress=progress, shared_key_scales=shared, **ws)
    if s.method == "kvquant":
        keys = calibrate_kvquant_keys(acts, s.key_bits, s.outliers, s.nuq, progress=progress, **ws)
        return [{"key": k, "value": Side("plain", s.value_quant()) if k.kind != "none" else
                 Side("none", QuantSpec(fmt="none"))} for k in keys]
    sides = ("value",) if s.method == "hybrid" else ("key", "value")
    layers = calibrate_skvq(acts, s.key_quant(), s.value_quant(), s.reorder, s.clip, progress=progress, sides=sides,
                            **ws)
    if s.method == "hybrid":
        keys = calibrate_kvquant_keys(acts, s.key_bits, s.outliers, s.nuq, progress=progress, **ws)
        for lay, k in zip(layers, keys):
            lay["key"] = k
    return layers


def calibrate(model: Any, data: CalibrationData, settings: CalibrationSettings, model_name: str = "model",
              progress: bool = True) -> Artifact:
    """Collect activations on ``data`` and calibrate ``settings.method``; returns an unsaved artifact.

    What the method needs of the model is checked first (:mod:`kvsqueeze.calibrate.requirements`): a method that
    cannot work on this model raises :class:`~kvsqueeze.calibrate.requirements.ModelRequirementError` before any
    activation is collected."""
    facts = check_model(model, settings.method, settings.transform if settings.method == "invertible" else None)
    layout = facts.layout
    acts = collect(model, data.ids, progress=progress, pre_rope=settings.method in PRE_ROPE_METHODS)
    layers = calibrate_activations(acts, settings, progress=progress, facts=facts)
    text = model.config.get_text_config(decoder=True)
    model_info = {"name": model_name, "num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
                  "num_heads": layout.num_heads, "head_dim": layout.head_dim,
                  "rope_theta": getattr(text, "rope_theta", None) or (getattr(text, "rope_parameters", None) or {})
                  .get("rope_theta")}
    exact = (0, 0) if settings.method == "vllm-fp8" else (settings.window, settings.sinks)  # vLLM keeps none
    if facts.sliding_layers:  # the artifact's cache then quantizes sliding layers with their calibrated sides
        model_info["layer_types"] = list(layout.layer_types)
    return Artifact(method=settings.method, name=settings.name(model_name), model=model_info,
                    window=exact[0], sinks=exact[1], calibration=data.provenance,
                    settings={k: getattr(settings, k) for k in settings.__dataclass_fields__},
                    layers=layers, rope=artifact_rope(acts))


def artifact_rope(acts: Activations) -> dict[str, Any]:
    """The artifact's RoPE record: the first layer's table, plus every layer's where they differ (per layer type);
    an empty table for a model without RoPE (nothing is un-rotated then)."""
    if acts.tables is None:
        return {"inv_freq": torch.zeros(0), "scaling": 1.0}
    rope: dict[str, Any] = {"inv_freq": acts.inv_freq, "scaling": acts.rope_scaling}
    if len(distinct_tables(acts.tables)) > 1:
        rope["layers"] = [(t.inv_freq, t.attention_scaling) for t in acts.tables]
    return rope


def method_defaults(method: str, grouping: str = "token") -> dict[str, Any]:
    """Defaults of the settings the CLI leaves unset: bits, group sizes and parameter dtype per method."""
    if method == "invertible":
        return {"key_bits": 4, "value_bits": 4.0, **GROUPING_DEFAULTS.get(grouping, GROUPING_DEFAULTS["token"])}
    return {"key_bits": 2, "value_bits": None, "key_group": 32, "value_group": 32, "param_dtype": "fp8-e4m3"}
