"""kvsqueeze's vLLM plugin (entry point ``vllm.general_plugins``: ``kvsqueeze``).

vLLM calls :func:`register` in each of its processes.  It does nothing unless ``$KVSQUEEZE_VLLM_KV`` names a
format of :mod:`kvsqueeze.kernels.paged` (``kivi-4``, ``kivi-2``, ``int8``); then it registers
:class:`kvsqueeze.engines.vllm_backend.KvsqueezeAttentionBackend` through vLLM's backend registry
(``register_backend``): as ``CUSTOM``, and on a CPU as the override of ``CPU_ATTN``, because vLLM's CPU platform
always picks ``CPU_ATTN`` whatever backend is asked for (overriding a member is what the registry is for).  No
vLLM file is patched.  Run vLLM with ``kv_cache_dtype="auto"`` and ``block_size=32``.
"""

from __future__ import annotations

import os
from typing import Any

ENV = "KVSQUEEZE_VLLM_KV"
BACKEND = "kvsqueeze.engines.vllm_backend.KvsqueezeAttentionBackend"


def register() -> None:
    """The entry point (it may run more than once per process: registering again is harmless)."""
    name = os.environ.get(ENV)
    if not name:
        return
    from ..kernels.paged import paged_format

    paged_format(name)  # an unknown format fails in vLLM's start-up, naming the allowed ones
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND)
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)


def unsupported_features(vllm_config: Any) -> list[str]:
    """What the engine is configured for that the backend's store cannot follow: prefix caching (a block shared
    between sequences while another may still rewrite it) and speculative decoding (rejected draft tokens rewrite
    slots of pages already packed)."""
    cache = getattr(vllm_config, "cache_config", None)
    return [what for what, on in (("prefix caching", bool(getattr(cache, "enable_prefix_caching", False))),
                                  ("speculative decoding", getattr(vllm_config, "speculative_config", None) is not None))
            if on]
