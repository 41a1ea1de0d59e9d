"""Append-only block storage for one layer's quantized (or full-precision) history.

Storage grows by whole preallocated blocks of ``block_tokens`` tokens; nothing already stored is ever copied,
re-encoded or concatenated when tokens are added.  Reading goes block by block, which bounds the memory of a
decoded chunk to one block.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .codecs import Codec


@dataclass
class _Block:
    start: int  # index of its first token within the store (counting evicted tokens)
    parts: dict[str, torch.Tensor]  # "k.codes", "v.scale", ...
    used: int = 0


class BlockStore:
    def __init__(self, key_codec: Codec, value_codec: Codec, batch: int, heads: int, block_tokens: int,
                 device: torch.device):
        self.codecs = {"k": key_codec, "v": value_codec}
        self.batch, self.heads, self.block_tokens, self.device = batch, heads, block_tokens, device
        self.blocks: list[_Block] = []
        self.end = 0  # tokens ever appended (minus truncations)
        self.begin = 0  # first token still stored (whole blocks are evicted for sliding-window layers)

    @property
    def n_tokens(self) -> int:
        return self.end - self.begin

    def _layouts(self):
        for side, codec in self.codecs.items():
            for name, lay in codec.layout().items():
                yield f"{side}.{name}", lay

    def _new_block(self, start: int) -> _Block:
        parts = {}
        for key, lay in self._layouts():
            rows = self.block_tokens // lay.tokens_per_row
            parts[key] = torch.empty((self.batch, self.heads, rows, *lay.tail), dtype=lay.dtype, device=self.device)
        return _Block(start, parts)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode tokens [B,H,T,D] once and write them after the last stored token."""
        t = k.shape[2]
        if t == 0:
            return
        encoded = {f"k.{n}": p for n, p in self.codecs["k"].encode(k).items()}
        encoded.update({f"v.{n}": p for n, p in self.codecs["v"].encode(v).items()})
        layouts = dict(self._layouts())
        # allocate every block needed before writing anything, so a failure leaves the store unchanged
        new_blocks, pos, last = [], self.end, (self.blocks[-1] if self.blocks else None)
        free = (self.block_tokens - last.used) if last is not None else 0
        need = t - free
        while need > 0:
            new_blocks.append(self._new_block(pos + free + len(new_blocks) * self.block_tokens))
            need -= self.block_tokens
        self.blocks.extend(new_blocks)
        written = 0
        for blk in self.blocks:
            if blk.used == self.block_tokens or blk.start + blk.used != self.end + written:
                continue
            n = min(self.block_tokens - blk.used, t - written)
            for key, src in encoded.items():
                r = layouts[key].tokens_per_row
                blk.parts[key][:, :, blk.used // r:(blk.used + n) // r] = src[:, :, written // r:(written + n) // r]
            blk.used += n
            written += n
            if written == t:
                break
        self.end += t

    def chunks(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield (first token index, keys, values) per block, decoded to float32; one block alive at a time."""
        for blk in self.blocks:
            if blk.used == 0:
                continue
            k_parts, v_parts = {}, {}
            layouts = dict(self._layouts())
            for key, t in blk.parts.items():
                side, name = key.split(".", 1)
                r = layouts[key].tokens_per_row
                (k_parts if side == "k" else v_parts)[name] = t[:, :, : blk.used // r]
            yield blk.start, self.codecs["k"].decode(k_parts), self.codecs["v"].decode(v_parts)

    def decode_range(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded tokens [a, b) (store indices); used only by crop."""
        ks, vs = [], []
        for start, k, v in self.chunks():
            lo, hi = max(a, start), min(b, start + k.shape[2])
            if lo < hi:
                ks.append(k[:, :, lo - start:hi - start])
                vs.append(v[:, :, lo - start:hi - start])
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)

    def truncate(self, n_end: int) -> None:
        """Forget tokens from store index ``n_end`` on (must fall on a token-group boundary)."""
        keep = []
        for blk in self.blocks:
            if blk.start >= n_end:
                continue
            blk.used = min(blk.used, n_end - blk.start)
            keep.append(blk)
        self.blocks = keep
        self.end = max(min(self.end, n_end), self.begin)

    def evict_before(self, index: int) -> None:
        """Drop whole blocks whose tokens all precede store index ``index`` (sliding-window layers)."""
        while self.blocks and self.blocks[0].used == self.block_tokens and \
                self.blocks[0].start + self.block_tokens <= index:
            self.blocks.pop(0)
        self.begin = self.blocks[0].start if self.blocks else self.end

    def map_batch(self, fn) -> None:
        """Apply ``fn`` (index_select / repeat_interleave on dim 0) to every stored tensor."""
        for blk in self.blocks:
            blk.parts = {k: fn(t) for k, t in blk.parts.items()}
        if self.blocks:
            self.batch = next(iter(self.blocks[0].parts.values())).shape[0]

    def nbytes(self) -> dict[str, int]:
        """Bytes of the stored tokens by kind (codes / params / fp), and the bytes allocated in blocks."""
        out = {"codes": 0, "params": 0, "fp": 0, "allocated": 0}
        layouts = dict(self._layouts())
        for blk in self.blocks:
            for key, t in blk.parts.items():
                lay = layouts[key]
                row_bytes = t[0, 0, 0].numel() * t.element_size() if t.shape[2] else 0
                out[lay.kind] += self.batch * self.heads * (blk.used // lay.tokens_per_row) * row_bytes
                out["allocated"] += t.numel() * t.element_size()
        for codec in self.codecs.values():
            for t in codec.state_tensors().values():
                out["params"] += t.numel() * t.element_size()
                out["allocated"] += t.numel() * t.element_size()
        return out
