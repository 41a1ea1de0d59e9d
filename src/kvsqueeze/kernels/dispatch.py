"""Backend switch for attention over the packed cache: {auto, torch, cpu, triton}.

``torch`` is the pure-torch reference (:mod:`kvsqueeze.kernels.reference`); faster backends register
themselves in ``BACKENDS`` from their own modules, imported lazily so ``import kvsqueeze`` never needs Triton
or a GPU.  ``auto`` picks the best backend available for the query's device.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from .reference import attend_segments

BACKEND_NAMES = ("auto", "torch", "cpu", "triton")

# name -> module that defines ``attend_layer(query, layer, mask, scaling) -> Tensor`` and ``available() -> bool``
_MODULES = {"cpu": "kvsqueeze.kernels.cpu", "triton": "kvsqueeze.kernels.triton_decode"}


def check_backend(name: str) -> str:
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; allowed: {', '.join(BACKEND_NAMES)}")
    return name


def reference_attend_layer(query, layer, mask, scaling):
    return attend_segments(query, layer.segments(), mask, scaling, kv_offset=layer.first_visible,
                           query_start=layer.n_total)


def _load(name: str):
    try:
        mod = importlib.import_module(_MODULES[name])
    except ImportError:
        return None
    return mod if mod.available() else None


def resolve(name: str, device: torch.device) -> Callable:
    """The attend function for a backend name; ``auto`` falls back to the reference when nothing faster is
    available, an explicit name that is unavailable is an error."""
    check_backend(name)
    if name == "torch":
        return reference_attend_layer
    if name == "auto":
        for cand in (("triton",) if device.type == "cuda" else ()) + ("cpu",) * (device.type == "cpu"):
            mod = _load(cand) if cand in _MODULES else None
            if mod is not None:
                return mod.attend_layer
        return reference_attend_layer
    mod = _load(name)
    if mod is None:
        raise ValueError(f"attention backend {name!r} is not available here (module {_MODULES[name]} missing or "
                         f"no suitable device); allowed here: torch" )
    return mod.attend_layer
