"""A vLLM attention backend that stores K/V in kvsqueeze formats inside vLLM's paged KV blocks (vLLM plugin).

Imported only inside vLLM's processes (never by kvsqueeze's own), after :func:`kvsqueeze.engines.vllm_plugin.register`
named it in vLLM's backend registry.

The backend asks vLLM for pages of ``token_bytes`` per (KV head, token) (``customize_spec``: vLLM sizes its pool
and counts blocks from that), writes tokens through :class:`~kvsqueeze.kernels.paged.PagedStore` (a page is packed
when its last slot is written; a sequence's last, partial page stays in full precision outside the pool) and
computes attention with :func:`~kvsqueeze.kernels.paged.paged_attention` on the packed pages (kvsqueeze's C++
kernel reading them in place on a CPU), for decode and chunked prefill alike.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from ..kernels.paged import PAGE_TOKENS, PagedStore, paged_attention, paged_format, pool_cell_bytes
from .vllm_plugin import ENV, unsupported_features


def _format():
    return paged_format(os.environ.get(ENV) or "kivi-4")


@functools.cache
def _announce(name: str) -> None:
    """Say once per process, in vLLM's log, which format is stored and what computes attention on it."""
    from ..kernels import cpu

    logging.getLogger("kvsqueeze").warning("kvsqueeze vLLM backend: pages in %s, attention by %s", name,
                                           cpu.describe()["path"])


class KvsqueezeAttentionBackend(AttentionBackend):
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return [PAGE_TOKENS]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [d for d in range(32, 513, 32)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)  # a KV head's page is one run of bytes

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        if spec.state_content_bytes is not None:
            return spec
        return replace(spec, state_content_bytes=pool_cell_bytes(_format(), spec.head_size))

    @staticmethod
    def get_impl_cls() -> type[KvsqueezeAttentionImpl]:
        return KvsqueezeAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KvsqueezeMetadataBuilder]:
        return KvsqueezeMetadataBuilder


@dataclass
class KvsqueezeMetadata:
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [S + 1], on the CPU
    seq_lens: torch.Tensor  # [S]
    block_table: torch.Tensor  # [S, max_blocks]
    slot_mapping: torch.Tensor


class KvsqueezeMetadataBuilder(AttentionMetadataBuilder[KvsqueezeMetadata]):
    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        refused = unsupported_features(vllm_config)
        if refused:
            raise NotImplementedError(f"kvsqueeze's vLLM backend does not implement {', '.join(refused)} "
                                      f"(serve with --no-enable-prefix-caching and without a speculative config)")

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KvsqueezeMetadata:
        m = common_attn_metadata
        return KvsqueezeMetadata(num_actual_tokens=m.num_actual_tokens, query_start_loc=m.query_start_loc_cpu,
                                 seq_lens=m.seq_lens.cpu(), block_table=m.block_table_tensor,
                                 slot_mapping=m.slot_mapping)


class KvsqueezeAttentionImpl(AttentionImpl[KvsqueezeMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None, **_: Any) -> None:
        unsupported = [what for what, on in (("ALiBi", alibi_slopes is not None),
                                             ("a sliding window", sliding_window not in (None, -1)),
                                             ("logit soft-capping", bool(logits_soft_cap)),
                                             ("attention sinks", sinks is not None),
                                             ("KV sharing", kv_sharing_target_layer_name is not None),
                                             (f"kv_cache_dtype {kv_cache_dtype!r}", kv_cache_dtype != "auto"))
                       if on]
        if unsupported:
            raise NotImplementedError(f"kvsqueeze's vLLM backend does not implement {', '.join(unsupported)}")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = None
        self.attn_type = attn_type
        self.store: PagedStore | None = None

    def _pages(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """vLLM's [blocks, H, N, C] view (model dtype) as bytes [blocks, H, N * C], the same memory."""
        b, h, n, _ = kv_cache.shape
        pages = kv_cache.view(torch.uint8).view(b, h, -1)
        if self.store is None:
            self.store = PagedStore(_format(), n, h, self.head_size)
            _announce(self.store.fmt.name)
        return pages

    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        pages = self._pages(kv_cache)
        self.store.write(pages, key, value, slot_mapping)

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: KvsqueezeMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None,
                ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvsqueeze's vLLM backend does not fuse output quantization")
        if attn_metadata is None:  # vLLM's warm-up and profiling runs
            return output
        t = attn_metadata.num_actual_tokens
        pages = self._pages(kv_cache)
        out = output[:t].view(t, self.num_heads, self.head_size)
        paged_attention(query[:t].view(t, self.num_heads, self.head_size), self.store, pages,
                        attn_metadata.block_table, attn_metadata.seq_lens, attn_metadata.query_start_loc,
                        self.scale, out=out)
        return output
