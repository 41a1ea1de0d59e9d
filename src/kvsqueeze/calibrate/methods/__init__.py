"""The registry of calibration methods: one module per method (a frozen settings dataclass and one entry point,
:class:`~.base.Method`).  ``kvsqueeze calibrate`` builds its ``--method`` choices and options from it, and
:func:`kvsqueeze.calibrate.calibrate` dispatches through it; a new method is a new module added to ``_MODULES``."""

from __future__ import annotations

import dataclasses
from typing import Any

from . import auto, hybrid, invertible, kvquant, skvq, vllm_fp8
from .base import Job, Method

_MODULES = (skvq, kvquant, hybrid, invertible, vllm_fp8, auto)
REGISTRY: dict[str, Method] = {m.METHOD.name: m.METHOD for m in _MODULES}


def get(name: str) -> Method:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; allowed: {', '.join(REGISTRY)}") from None


def method_of(settings: Any) -> Method:
    """The registered method of a settings object."""
    m = get(settings.method)
    if not isinstance(settings, m.settings):
        raise TypeError(f"{type(settings).__name__} is not the settings class of {m.name} ({m.settings.__name__})")
    return m


def options() -> dict[str, tuple[dataclasses.Field, list[str]]]:
    """Every settings field of every method, once: name -> (the first method's field, the methods having it)."""
    out: dict[str, tuple[dataclasses.Field, list[str]]] = {}
    for m in REGISTRY.values():
        for f in m.fields():
            if f.name in out:
                out[f.name][1].append(m.name)
            else:
                out[f.name] = (f, [m.name])
    return out


def settings_from(method: str, given: dict[str, Any], cli: bool = False) -> Any:
    """The method's settings from the fields ``given`` (None = unset); ``cli`` applies the method's command-line
    defaults (those depending on another option).  ValueError names an option the method does not take."""
    m = get(method)
    own = {f.name for f in m.fields()}
    given = {k: v for k, v in given.items() if v is not None}
    foreign = sorted(set(given) - own)
    if foreign:
        raise ValueError(f"--method {method} takes no {', '.join('--' + k.replace('_', '-') for k in foreign)}")
    kw = {**(m.cli_defaults(given) if cli else {}), **given}
    return m.settings(**kw)


__all__ = ["REGISTRY", "Job", "Method", "get", "method_of", "options", "settings_from"]
