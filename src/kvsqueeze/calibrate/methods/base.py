"""What a calibration method plug-in is: a frozen settings dataclass whose fields carry their command-line
metadata, and one entry point that turns a :class:`Job` (model, calibration data, model facts) into per-layer
artifact sides.  ``kvsqueeze calibrate`` builds its options from the registered settings classes."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...artifact import Side
from ...layout import AttentionFacts
from ..collect import Activations, CalibrationData, collect

KEY_BITS = (1, 2, 3, 4, 8)
VALUE_BITS = (1.5, 1, 2, 3, 4, 8)  # 1.5 = the ternary format (docs/calibrated.md)
PARAM_DTYPES = ("fp8-e4m3", "fp16", "bf16", "fp32")


def option(default: Any, help: str, *, choices: tuple | list | None = None, type: Callable | None = None,
           flag: str | None = None, negate: bool = False) -> Any:
    """A settings field with its command-line form: ``--field-name`` (or ``flag``); for a boolean, a switch that
    sets True (or False with ``negate``, e.g. ``--no-reorder``)."""
    return field(default=default, metadata={"help": help, "choices": choices, "type": type, "flag": flag,
                                            "negate": negate})


def check_choice(what: str, value: Any, allowed: tuple | list) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; allowed: {', '.join(map(str, allowed))}")


def check_bits(key_bits: int | None = None, value_bits: float | None = None) -> None:
    if key_bits is not None and key_bits not in KEY_BITS:
        raise ValueError(f"unsupported key bits {key_bits}; allowed: 1, 2, 3, 4, 8")
    if value_bits is not None and value_bits not in VALUE_BITS:
        raise ValueError(f"unsupported value bits {value_bits}; allowed: 1.5 (ternary), 1, 2, 3, 4, 8")


def check_exact(window: int, sinks: int) -> None:
    if window < 0 or sinks < 0:
        raise ValueError("window and sinks must be non-negative")


def value_label(value_bits: float) -> str:
    return "1.5" if value_bits == 1.5 else str(int(value_bits))


def group_label(x: int | None) -> str:
    return "all" if x is None else str(x)


def clean_name(parts: list[str]) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join(parts))


@dataclass
class Job:
    """What an entry point gets: the model, its calibration ids, the model's attention facts, and activations
    collected on first use (post-RoPE, plus pre-RoPE keys when the method stores keys before RoPE)."""

    model: Any
    data: CalibrationData
    facts: AttentionFacts | None
    progress: bool = True
    pre_rope: bool = False
    _acts: Activations | None = None

    def activations(self) -> Activations:
        if self._acts is None:
            self._acts = collect(self.model, self.data.ids, progress=self.progress, pre_rope=self.pre_rope)
        return self._acts


@dataclass(frozen=True)
class Method:
    """One registered method.  ``from_activations(acts, settings, progress, facts)`` is the entry point of
    methods that need only collected activations; ``run(job, settings)`` that of methods that also run the model
    (it defaults to collecting activations and calling ``from_activations``)."""

    name: str
    help: str
    settings: type
    from_activations: Callable[..., list[dict[str, Side]]] | None = None
    run: Callable[[Job, Any], list[dict[str, Side]]] | None = None
    pre_rope: bool = False  # keys stored before RoPE: activations un-rotated at collection
    keeps_exact: bool = True  # False: the artifact keeps no full-precision window or sinks (vLLM keeps none)
    cli_defaults: Callable[[dict[str, Any]], dict[str, Any]] = field(default=lambda given: {})

    def calibrate(self, job: Job, settings: Any) -> list[dict[str, Side]]:
        if self.run is not None:
            return self.run(job, settings)
        assert self.from_activations is not None
        return self.from_activations(job.activations(), settings, job.progress, job.facts)

    def transform(self, settings: Any) -> str | None:
        """The key/value transform the model requirements are checked against (invertible only)."""
        return getattr(settings, "transform", None)

    def fields(self) -> list[dataclasses.Field]:
        return list(dataclasses.fields(self.settings))
