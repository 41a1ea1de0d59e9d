"""kvsqueeze: small and fast quantized KV caches for transformer language models.

    import kvsqueeze
    model, tok = kvsqueeze.load_model()                      # the embedded SmolLM2-135M
    cache = kvsqueeze.QuantizedCache(model.config, "kivi-2")
    model.generate(**tok("Hello", return_tensors="pt"), **kvsqueeze.cache_kwargs(model, cache), max_new_tokens=32)
    print(cache.summary())

``resolve_kv(x)`` is what every cache name goes through (presets, spec strings, JSON, calibration artifact
directories, registered peers); every error kvsqueeze raises for bad input is a ``KvsqueezeError``.

Heavy modules (torch, transformers) are imported on first use of the names that need them.
"""

from __future__ import annotations

from ._version import __version__
from .errors import KvsqueezeError
from .spec import PRESETS, CacheSpec, QuantSpec, preset

_LAZY = {
    "QuantizedCache": ("kvsqueeze.adapter", "QuantizedCache"),
    "StaticQuantizedCache": ("kvsqueeze.adapter", "StaticQuantizedCache"),
    "KVBytes": ("kvsqueeze.adapter", "KVBytes"),
    "patch": ("kvsqueeze.adapter", "patch"),
    "cache_kwargs": ("kvsqueeze.adapter", "cache_kwargs"),
    "load_model": ("kvsqueeze.models", "load_model"),
    "resolve_kv": ("kvsqueeze.resolve", "resolve_kv"),  # reads artifacts: imports torch
}

__all__ = ["PRESETS", "CacheSpec", "KvsqueezeError", "QuantSpec", "preset", "__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'kvsqueeze' has no attribute {name!r}")
