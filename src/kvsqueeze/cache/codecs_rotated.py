"""The rotated codebook codec (``fmt="rot"`` / ``"rot-qjl"``): data-oblivious, no calibration (docs/rotated.md).

Each token's key (after RoPE: the cache receives post-RoPE keys) or value of each head is stored as

* ``codes``: one Lloyd-Max code per coordinate of the rotated unit vector ``(x / |x|) @ R``, packed with
  :func:`kvsqueeze.quant.pack_bits` (the high-bit coordinates' bytes, then the low-bit ones' for fractional
  widths);
* ``norm``: the code vector's scale in the spec's ``param_dtype`` (fp16 by default): the least-squares scale of
  the codes, close to ``|x|`` (:func:`kvsqueeze.quant.codebook.codebook_fit`) - the only parameter;
* centred (``axis="channel"``, ``group=G``: tokens are stored G at a time) instead of ``norm``: ``stats``, one row
  per G-token group holding the group's per-channel mean in the rotated space (D values) and then the scales of
  its G tokens; each token's codes are those of its rotated vector minus that mean.  One part holds both, so the
  kernels read a centred side through the same three tensors as a plain one;
* ``rot-qjl`` only: ``sketch``, the 1-bit signs of the residual projected on a fixed Gaussian matrix (packed,
  d/8 bytes), and ``rnorm``, the residual's norm.

Decoding is ``x_hat = (mean + scale * levels(codes)) R^T`` (mean 0 when not centred); ``decode`` undoes the rotation, so every attention path sees original-space vectors; the C++ kernel instead
rotates the query once and reads the codes directly (kernels/cpu.py).
"""

from __future__ import annotations

import torch

from ..quant import pack_bits, param_torch_dtype, unpack_bits
from ..quant.codebook import (
    DENSITY,
    ROTATION_SEED,
    SKETCH_SEED,
    codebook_fit,
    codebook_values,
    expand_groups,
    group_means,
    lloyd_max,
    pack_split,
    rotated_dequantize,
    rotated_kernel_table,
    rotated_quantize,
    sign_sketch,
    sketch_estimate,
    sketch_matrix,
    split_bits,
    unpack_split,
)
from ..quant.format import storage_format
from ..quant.nonfinite import finite_vectors
from ..quant.rotation import rotate, rotation_matrix, unrotate
from ..spec import QuantSpec
from .codecs import Codec, PartLayout


class RotatedCodec(Codec):
    """Scale + rotated Lloyd-Max codes per token and head (centred: minus a per-group channel mean; optionally
    a residual sign sketch)."""

    def __init__(self, spec: QuantSpec, head_dim: int):
        self.spec, self.fmt = spec, storage_format(spec, head_dim, torch.float32)
        self.split = split_bits(spec.bits, head_dim)
        self.density = DENSITY
        self.rotation = rotation_matrix(head_dim, ROTATION_SEED)
        self.pdtype = param_torch_dtype(spec.param_dtype)
        self.sketch = spec.fmt == "rot-qjl"
        self.proj = sketch_matrix(head_dim, seed=SKETCH_SEED) if self.sketch else None
        self.group = spec.group if spec.axis == "channel" else None  # tokens per centred group

    def codebooks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Levels of the high-bit and the low-bit codebook (float32), as the kernels read them."""
        s = self.split
        return (lloyd_max(s.bits_hi, s.dim, self.density).levels_tensor(),
                lloyd_max(s.bits_lo, s.dim, self.density).levels_tensor())

    def kernel_table(self) -> torch.Tensor:
        """The rotation and level tables the C++ kernel reads (see quant.codebook.rotated_kernel_table)."""
        return rotated_kernel_table(self.head_dim, self.spec.bits)

    def layout(self) -> dict[str, PartLayout]:
        out = {"codes": PartLayout((self.split.nbytes,), torch.uint8, 1, "codes")}
        if self.group:
            out["stats"] = PartLayout((self.head_dim + self.group,), self.pdtype, self.group, "params")
        else:
            out["norm"] = PartLayout((1,), self.pdtype, 1, "params")
        if self.sketch:
            out["sketch"] = PartLayout((self.head_dim // 8,), torch.uint8, 1, "codes")
            out["rnorm"] = PartLayout((1,), self.pdtype, 1, "params")
        return out

    def encode(self, x, start=0, shared=None):
        # one scale per token vector: NaN -> 0, +-inf -> +- the vector's largest finite magnitude (nonfinite.py)
        x = finite_vectors(x)
        if self.group:
            return self._encode_centred(x)
        codes, norm = rotated_quantize(x, self.split, self.rotation, self.density, self.pdtype)
        out = {"codes": pack_split(codes, self.split), "norm": norm}
        if self.sketch:
            resid = x.float() - rotated_dequantize(codes, norm, self.split, self.rotation, self.density)
            bits, rnorm = sign_sketch(resid, self.proj, self.pdtype)
            out["sketch"], out["rnorm"] = pack_bits(bits, 1), rnorm
        return out

    def _encode_centred(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = rotate(x.float(), self.rotation)
        mean = group_means(y, self.group, self.pdtype)  # [B, H, T/G, D]
        codes, scale = codebook_fit(y - expand_groups(mean, self.group), self.split, self.density, self.pdtype)
        *lead, t, _ = x.shape
        stats = torch.cat([mean, scale.reshape(*lead, t // self.group, self.group)], dim=-1)
        return {"codes": pack_split(codes, self.split), "stats": stats}

    def decode(self, parts, start=0, shared=None):
        codes = unpack_split(parts["codes"], self.split)
        if self.group:
            stats, d = parts["stats"], self.head_dim
            *lead, n, _ = stats.shape
            scale = stats[..., d:].float().reshape(*lead, n * self.group, 1)
            y = codebook_values(codes, self.split, self.density) * scale + expand_groups(stats[..., :d], self.group)
            return unrotate(y, self.rotation)
        x = rotated_dequantize(codes, parts["norm"], self.split, self.rotation, self.density)
        if self.sketch:
            x = x + sketch_estimate(unpack_bits(parts["sketch"], 1, self.head_dim), parts["rnorm"], self.proj)
        return x
