"""The exported static step modules run eagerly in PyTorch on the manager's buffers.

This is the PyTorch side of the ONNX Runtime comparison and a reference for the graphs: same modules, same
manager, same greedy loop (:func:`~kvsqueeze.engines.static_generation.greedy_generate`).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from .static_manager import StaticKVManager, StaticKVQuant, check_manager_matches, manager_for
from .static_step import StaticStep


class TorchStaticEngine:
    """The exported prefill/decode modules run in eager PyTorch on the manager's buffers (zero-copy views in,
    new K/V copied into the slot after the window)."""

    name = "pytorch-static"

    def __init__(self, model: torch.nn.Module, max_len: int, *, quant: StaticKVQuant | None = None,
                 layout: str = "token", batch_size: int = 1) -> None:
        self.prefill_step = StaticStep(model, max_len, "prefill", layout=layout, quant=quant).eval()
        self.decode_step = StaticStep(model, max_len, "decode", layout=layout, quant=quant).eval()
        s = self.decode_step
        stored = quant.stored_dim(s.head_dim) if quant else s.head_dim
        self.dtype = np.dtype(np.float32) if quant is None else quant.storage_dtype
        self.info = SimpleNamespace(max_len=max_len, batch_size=batch_size, layout=layout, n_layers=s.n_layers,
                                    n_kv_heads=s.n_kv, stored_dim=stored)

    def make_manager(self, reserve: float = 2.0, on_full: str = "stop", naive: bool = False) -> StaticKVManager:
        return manager_for(self.info, self.dtype, reserve, on_full, naive)

    def check_manager(self, m: StaticKVManager) -> None:
        check_manager_matches(m, self.info, self.dtype, "this engine")

    @torch.inference_mode()
    def prefill(self, m: StaticKVManager, input_ids: np.ndarray, attention_mask: np.ndarray,
                position_ids: np.ndarray) -> np.ndarray:
        out = self.prefill_step(*(torch.from_numpy(np.asarray(a, np.int64)) for a in
                                  (input_ids, attention_mask, position_ids)))
        for layer, (kw, vw) in enumerate(m.prefill_views()):
            kw[...] = out[1 + 2 * layer].numpy()
            vw[...] = out[2 + 2 * layer].numpy()
        m.stats.bytes_written += 2 * m.n_layers * m.window_len * m.token_bytes
        m.commit_prefill(np.asarray(attention_mask).sum(axis=1))
        return out[0].numpy()

    @torch.inference_mode()
    def decode(self, m: StaticKVManager, input_ids: np.ndarray) -> np.ndarray:
        m.prepare(1)
        past = [torch.from_numpy(a) for layer in range(m.n_layers) for a in m.window(layer)]
        out = self.decode_step(torch.from_numpy(np.asarray(input_ids, np.int64)),
                               torch.from_numpy(m.attention_mask()), torch.from_numpy(m.position_ids()), *past)
        for layer in range(m.n_layers):
            ks, vs = m.slot(layer)
            ks[...] = out[1 + 2 * layer].numpy()
            vs[...] = out[2 + 2 * layer].numpy()
        m.stats.bytes_written += 2 * m.n_layers * m.token_bytes
        m.commit(1)
        return out[0].numpy()
