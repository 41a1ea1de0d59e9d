"""One entry point for every calibrated method: collect activations, calibrate each side, build the artifact.

The methods are plug-ins (:mod:`kvsqueeze.calibrate.methods`): each has its own frozen settings dataclass and one
entry point; this module only dispatches through the registry."""

from __future__ import annotations

from typing import Any

import torch

from ..artifact import Artifact, Side
from ..layout import AttentionFacts
from ..rope import distinct_tables
from .collect import Activations, CalibrationData
from .methods import REGISTRY, Job, get, method_of
from .requirements import check_model

METHODS = tuple(REGISTRY)
PRE_ROPE_METHODS = tuple(m.name for m in REGISTRY.values() if m.pre_rope)  # activations un-rotated at collection
METHOD_HELP = {m.name: m.help for m in REGISTRY.values()}

# the defaults of the one flat settings object this API had before the plug-ins (CalibrationSettings below keeps
# old callers' settings exactly as they were)
_FLAT_DEFAULTS: dict[str, Any] = {
    "key_bits": 2, "value_bits": 1.5, "key_group": 32, "value_group": 32, "param_dtype": "fp8-e4m3", "reorder": True,
    "clip": "layer", "outliers": 1, "nuq": False, "window": 128, "sinks": 4, "transform": "learned-folded",
    "grouping": "token", "steps": 150, "rank": 8, "seed": 0, "fp8_format": "e4m3", "rounding": "truncate",
    "compensate": True, "rotate_keys": True}


def CalibrationSettings(method: str = "skvq", **kw: Any) -> Any:  # noqa: N802 - the former class's name
    """Settings of ``method`` from the former flat keywords (fields of other methods are ignored; unset ones take
    the former flat defaults).  New code builds the method's own class, e.g.
    :class:`kvsqueeze.calibrate.methods.skvq.SkvqSettings`."""
    m = get(method)
    own = {f.name for f in m.fields()}
    unknown = sorted(set(kw) - own - set(_FLAT_DEFAULTS))
    if unknown:
        raise TypeError(f"unknown calibration settings: {', '.join(unknown)}")
    merged = {**_FLAT_DEFAULTS, **kw}
    return m.settings(**{k: v for k, v in merged.items() if k in own})


def settings_dict(settings: Any) -> dict[str, Any]:
    """What the artifact records of its settings: the method and every field."""
    return {"method": settings.method, **{k: getattr(settings, k) for k in settings.__dataclass_fields__}}


def calibrate_activations(acts: Activations, settings: Any, progress: bool = True,
                          facts: AttentionFacts | None = None) -> list[dict[str, Side]]:
    """Calibrate every layer from collected activations (methods that need only activations); ``facts``
    (:func:`kvsqueeze.layout.attention_facts`) adapt the method to the model."""
    m = method_of(settings)
    if m.from_activations is None:
        raise ValueError(f"--method {m.name} runs the model itself: use calibrate()")
    return m.from_activations(acts, settings, progress, facts)


def calibrate(model: Any, data: CalibrationData, settings: Any, model_name: str = "model",
              progress: bool = True) -> Artifact:
    """Collect activations on ``data`` and calibrate ``settings.method``; returns an unsaved artifact.

    What the method needs of the model is checked first (:mod:`kvsqueeze.calibrate.requirements`): a method that
    cannot work on this model raises :class:`~kvsqueeze.calibrate.requirements.ModelRequirementError` before any
    activation is collected."""
    m = method_of(settings)
    facts = check_model(model, m.name, m.transform(settings))
    layout = facts.layout
    job = Job(model, data, facts, progress=progress, pre_rope=m.pre_rope)
    layers = m.calibrate(job, settings)
    text = model.config.get_text_config(decoder=True)
    model_info = {"name": model_name, "num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
                  "num_heads": layout.num_heads, "head_dim": layout.head_dim,
                  "rope_theta": getattr(text, "rope_theta", None) or (getattr(text, "rope_parameters", None) or {})
                  .get("rope_theta")}
    exact = (settings.window, settings.sinks) if m.keeps_exact else (0, 0)
    if facts.sliding_layers:  # the artifact's cache then quantizes sliding layers with their calibrated sides
        model_info["layer_types"] = list(layout.layer_types)
    return Artifact(method=m.name, name=settings.name(model_name), model=model_info,
                    window=exact[0], sinks=exact[1], calibration=data.provenance,
                    settings=settings_dict(settings), layers=layers, rope=artifact_rope(job.activations()))


def artifact_rope(acts: Activations) -> dict[str, Any]:
    """The artifact's RoPE record: the first layer's table, plus every layer's where they differ (per layer type);
    an empty table for a model without RoPE (nothing is un-rotated then)."""
    if acts.tables is None:
        return {"inv_freq": torch.zeros(0), "scaling": 1.0}
    rope: dict[str, Any] = {"inv_freq": acts.inv_freq, "scaling": acts.rope_scaling}
    if len(distinct_tables(acts.tables)) > 1:
        rope["layers"] = [(t.inv_freq, t.attention_scaling) for t in acts.tables]
    return rope
