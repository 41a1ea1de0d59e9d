"""Calibration for vLLM's fp8 KV cache (``kvsqueeze calibrate --method vllm-fp8``).

vLLM stores each layer's keys and values as fp8 with one fp32 scale per layer and side (``k_scale``, ``v_scale``
of a compressed-tensors checkpoint; its CPU path takes only per-tensor scales).  Its CPU kernels
(``csrc/cpu/cpu_attn_fp8.hpp`` in vLLM 0.32) convert by *truncation*: ``x / scale`` is clamped to the format's
maximum and its mantissa is cut to 3 (e4m3) or 2 (e5m2) bits, never rounded.  Every stored element therefore
shrinks towards zero - on average by about 4% (e4m3) or 9% (e5m2) of its magnitude - so every attention logit is
multiplied by about 0.96 or 0.91 and every attention output shrinks likewise.  A scale cannot undo that (the
shrink is relative), but the model can: queries are never quantized, so multiplying ``W_q`` by ``c_k`` restores
the logits, and multiplying the ``o_proj`` input columns by ``c_v`` restores the attention output.

Per layer (and KV head, for the compensations) this module chooses, on the calibration split:

* ``k_scale`` / ``v_scale`` from a grid of powers of two around absmax/max_fp8 (the naive choice is its centre),
  minimising the mean squared error of the compensated dequantized tensor;
* ``c_k`` / ``c_v`` by least squares (``c = <x, x~> / <x~, x~>`` with ``x~`` the dequantized tensor).

:func:`vllm_fp8_dequant` is the reference of vLLM's conversion (checked bit for bit against torch's float8 types on
every representable value) and the emulation used where vLLM's fp8 cache cannot run (x86 without AVX-512).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..artifact import Side
from ..spec import QuantSpec

FP8_FORMATS = ("e4m3", "e5m2")
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
ROUNDINGS = ("truncate", "nearest")  # vLLM's CPU kernels truncate; torch's float8 casts round to nearest
SCALE_GRID = tuple(2.0 ** e for e in range(-3, 9))  # multiples of absmax / max_fp8 (1 = the naive scale)
_MANTISSA_DROP = {"e4m3": 20, "e5m2": 21}  # float32 mantissa bits below the fp8 mantissa
_TORCH = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def vllm_fp8_dequant(x: torch.Tensor, fmt: str, scale: float | torch.Tensor, rounding: str = "truncate"
                     ) -> torch.Tensor:
    """``dequant(quant(x))`` as vLLM's fp8 KV cache computes it: ``fp8(x / scale) * scale`` (float32 out).

    ``rounding="truncate"`` mirrors vLLM's CPU conversion (clamp, then cut the mantissa; values below the
    smallest subnormal become zero); ``"nearest"`` is IEEE round-to-nearest-even (torch's float8 casts, vLLM's
    CUDA kernels)."""
    if fmt not in FP8_FORMATS:
        raise ValueError(f"unknown fp8 format {fmt!r}; allowed: {', '.join(FP8_FORMATS)}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; allowed: {', '.join(ROUNDINGS)}")
    scale = torch.as_tensor(scale, dtype=torch.float32)
    y = (x.float() / scale).clamp(-FP8_MAX[fmt], FP8_MAX[fmt])
    if rounding == "nearest":
        return y.to(_TORCH[fmt]).float() * scale
    # bias the exponent so that fp8's subnormal range lands on float32's subnormal range (as the kernel does
    # for e4m3), then cut the mantissa: the float32 value of the truncated code
    shift = {"e4m3": 2.0 ** -120, "e5m2": 2.0 ** -112}[fmt]
    bits = (y * shift).view(torch.int32)
    mask = ~((1 << _MANTISSA_DROP[fmt]) - 1)
    cut = (bits & mask).view(torch.float32) / shift
    return cut * scale


@dataclass(frozen=True)
class SideCalibration:
    scale: float  # vLLM's k_scale / v_scale
    naive_scale: float  # absmax / max_fp8 on the calibration split
    compensation: torch.Tensor  # [H] multiplier folded into W_q (keys) or the o_proj input (values)
    mse: float  # relative MSE of the compensated dequantized tensor at ``scale``
    naive_mse: float  # the same at the naive scale without compensation


def calibrate_side(x: torch.Tensor, fmt: str, rounding: str = "truncate",
                   grid: tuple[float, ...] = SCALE_GRID) -> SideCalibration:
    """Scale and per-head compensation for one layer's keys or values ``x`` [N, H, L, D]."""
    x = x.float()
    absmax = float(x.abs().max())
    naive = max(absmax, 1e-12) / FP8_MAX[fmt]
    energy = float(x.pow(2).sum()) or 1.0
    best = None
    for m in grid:
        s = naive * m
        q = vllm_fp8_dequant(x, fmt, s, rounding)
        c = _least_squares(x, q)
        err = float((x - q * c[None, :, None, None]).pow(2).sum()) / energy
        if best is None or err < best[0]:
            best = (err, s, c)
    q0 = vllm_fp8_dequant(x, fmt, naive, rounding)
    naive_err = float((x - q0).pow(2).sum()) / energy
    return SideCalibration(best[1], naive, best[2], best[0], naive_err)


def _least_squares(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per head c minimising ||x - c q||^2."""
    num = (x * q).sum(dim=(0, 2, 3))
    den = q.pow(2).sum(dim=(0, 2, 3)).clamp_min(1e-30)
    return (num / den).where(den > 1e-30, torch.ones_like(num))


ANGLE_GRID = 16  # pair rotation angles tried in [0, pi/2) (a quarter turn maps the family onto itself)


@torch.no_grad()
def key_pair_angles(q: torch.Tensor, k: torch.Tensor, scaling: float, steps: int = ANGLE_GRID) -> torch.Tensor:
    """Per KV head and RoPE pair, the rotation angle that spreads the score products over the pair's channels.

    An fp8 key's error is relative per element, so the error of a score ``sum_c q_c k_c`` has variance
    ``~ sum_c (q_c k_c)^2``: the more one channel carries the score, the larger.  A rotation of a RoPE pair by a
    fixed angle commutes with RoPE (it folds into W_q and W_k exactly) and changes how a pair's product splits
    between its two channels; for the slow pairs, which RoPE barely turns over a context, that split is nearly
    fixed, and a massive one-channel key is split in two.  The angle minimises the attention-weighted sum of
    squared products over the calibration tokens.  q [N, Hq, L, D], k [N, Hkv, L, D] after RoPE."""
    n, hq, length, d = q.shape
    hkv, half = k.shape[1], d // 2
    rep = hq // hkv
    kk = k.repeat_interleave(rep, dim=1).float()
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    m = torch.zeros(hkv, half, 3, 3, dtype=torch.float64)
    for i in range(n):  # one sample at a time keeps the attention matrix small
        qi, ki = q[i].float(), kk[i]
        a = (qi @ ki.transpose(-1, -2) * scaling).masked_fill(~causal, float("-inf")).softmax(-1)  # [Hq, L, L]
        g = torch.stack([ki[..., :half] ** 2, ki[..., :half] * ki[..., half:], ki[..., half:] ** 2], -1)
        f = torch.stack([qi[..., :half] ** 2, qi[..., :half] * qi[..., half:], qi[..., half:] ** 2], -1)
        ag = torch.einsum("hqk,hkpc->hqpc", a, g)
        mh = torch.einsum("hqpa,hqpb->hpab", f, ag).double()  # [Hq, half, 3, 3]
        m += mh.view(hkv, rep, half, 3, 3).sum(1)
    phis = torch.arange(steps, dtype=torch.float64) * (torch.pi / 2 / steps)
    c, s = torch.cos(phis), torch.sin(phis)
    wr = torch.stack([c * c, -2 * c * s, s * s], -1)  # weights of (x^2, xy, y^2) in the rotated real channel
    wi = torch.stack([s * s, 2 * c * s, c * c], -1)  # ... and in the rotated imaginary channel
    cost = (torch.einsum("ga,hpab,gb->hpg", wr, m, wr) + torch.einsum("ga,hpab,gb->hpg", wi, m, wi))
    return phis[cost.argmin(-1)].float()


def calibrate_vllm_fp8(acts: Any, fmt: str, rounding: str = "truncate", compensate: bool = True,
                       rotate_keys: bool = True, progress: bool = True) -> list[dict[str, Side]]:
    """Artifact layers for vLLM's fp8 cache: per layer and side a plain fp8 per-tensor QuantSpec with tensors
    ``vllm_scale`` (a scalar) and ``compensation`` [H] (ones when ``compensate`` is off), and with
    ``rotate_keys`` a RoPE-commuting key transform (:func:`key_pair_angles`) that export folds into the weights."""
    from tqdm.auto import tqdm

    from ..transforms.matrices import rope_commuting, rope_commuting_inverse

    quant = QuantSpec(fmt=f"fp8-{fmt}", fp8_scale="tensor")
    layers = []
    for la in tqdm(acts.layers, desc=f"vllm-fp8 {fmt} scales", disable=not progress):
        if la is None:
            none = Side("none", QuantSpec(fmt="none"))
            layers.append({"key": none, "value": none})
            continue
        sides = {}
        key_extra: dict[str, torch.Tensor] = {}
        key_info: dict[str, Any] = {}
        k = la.k
        if rotate_keys:
            phi = key_pair_angles(la.q, la.k, la.scaling)
            zero = torch.zeros_like(phi)
            a = rope_commuting(zero.double(), phi.double())
            k = (la.k.double() @ a[None]).float()  # rotating after RoPE = rotating before it (they commute)
            key_extra = {"transform": a.float(), "transform_inv": rope_commuting_inverse(zero.double(),
                                                                                         phi.double()).float()}
            key_info = {"transform": {"family": "rope-commuting", "name": "pair-rotation"}}
        for name, x in (("key", k), ("value", la.v)):
            cal = calibrate_side(x, fmt, rounding)
            comp = cal.compensation if compensate else torch.ones_like(cal.compensation)
            extra = key_extra if name == "key" else {}
            info = key_info if name == "key" else {}
            sides[name] = Side("plain", quant, {"vllm_scale": torch.tensor(cal.scale, dtype=torch.float32),
                                                "compensation": comp.float(), **extra},
                               {"vllm_fp8": {"format": fmt, "rounding": rounding, "naive_scale": cal.naive_scale,
                                             "relative_mse": cal.mse, "naive_relative_mse": cal.naive_mse,
                                             "compensated": compensate}, **info})
        layers.append(sides)
    return layers


@torch.no_grad()
def emulated_nll(model: Any, chunks: torch.Tensor, fmt: str | None, k_scales: list[float] | None = None,
                 v_scales: list[float] | None = None, rounding: str = "truncate") -> torch.Tensor:
    """Per-token NLL [N, T-1] of ``chunks`` with every token's K/V stored as vLLM's fp8 cache stores it
    (:func:`vllm_fp8_dequant` with per-layer scales, default 1.0 as vLLM uses without checkpoint scales); queries,
    weights and attention stay in the model's dtype.  ``fmt=None``: no quantization (the reference)."""
    from ..adapter import attention_override, sdpa_attention_forward

    def attn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        if fmt is not None:
            i = module.layer_idx
            ks = 1.0 if k_scales is None else k_scales[i]
            vs = 1.0 if v_scales is None else v_scales[i]
            key = vllm_fp8_dequant(key, fmt, ks, rounding).to(key.dtype)
            value = vllm_fp8_dequant(value, fmt, vs, rounding).to(value.dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kw)

    rows = []
    with attention_override(model, attn):
        for i in range(chunks.shape[0]):
            ids = chunks[i:i + 1].to(model.device)
            logits = model(input_ids=ids).logits[0, :-1].float()
            rows.append(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none"))
    return torch.stack(rows)
