"""How rotated codebook bits are best split between keys and values: attention-output error per side and width.

    KVSQUEEZE_DATA=../shared/data python benchmarks/rotated_allocation.py --threads 1

One chunk of ``--context`` WikiText-2 test tokens goes through the embedded model once; every ``--every``-th
layer's post-RoPE queries, keys and values are captured.  For each code width, keys only (values exact) and values
only (keys exact) are quantized with the rotated codebook format (every token, causal attention) and the table
prints the relative squared error of the attention output, ``|o_hat - o|^2 / |o|^2``, averaged over those layers,
beside KIVI's (per-channel keys / per-token values, groups of 32) at the same bits.  A quick proxy for choosing
splits; perplexity (benchmarks/rotated_table.py) decides.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from kvsqueeze import corpus as corpus_mod
from kvsqueeze.adapter import attention_override
from kvsqueeze.cache.emulate import fake_quantize_cache
from kvsqueeze.eval import meta
from kvsqueeze.quant import bits_per_element
from kvsqueeze.spec import CacheSpec, QuantSpec, preset

WIDTHS = (2, 2.25, 2.5, 2.75, 3, 3.25, 3.5, 3.75, 4)


def capture(model, ids: torch.Tensor, every: int) -> dict[int, tuple[torch.Tensor, ...]]:
    """Post-RoPE (q, k, v) [H, T, D] of every ``every``-th layer."""
    out: dict[int, tuple[torch.Tensor, ...]] = {}

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        if module.layer_idx % every == 0:
            out[module.layer_idx] = (query[0].clone(), key[0].clone(), value[0].clone())
        o = causal(query[0], key[0], value[0])
        return o.reshape(query.shape).transpose(1, 2).contiguous(), None

    with torch.no_grad(), attention_override(model, attend):
        model.base_model(input_ids=ids, use_cache=False)
    return out


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    hq, t, d = q.shape
    hk = k.shape[0]
    s = torch.einsum("hrtd,hsd->hrts", q.view(hk, hq // hk, t, d), k) * d ** -0.5
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.einsum("hrts,hsd->hrtd", s.softmax(-1), v).reshape(hq, t, d)


def side_error(layers, spec: CacheSpec, side: str) -> float:
    spec = dataclasses.replace(spec, window=0, sinks=0)
    total = 0.0
    for q, k, v in layers.values():
        kh, vh = fake_quantize_cache(k[None], v[None], spec)
        o = causal(q, k, v)
        oh = causal(q, kh[0], v) if side == "key" else causal(q, k, vh[0])
        total += float(((oh - o) ** 2).sum() / (o ** 2).sum())
    return total / len(layers)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--every", type=int, default=3, help="capture every N-th layer (default 3)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    model, tok, threads = meta.load_for_eval(None, args.threads)
    corpus = corpus_mod.resolve_corpus(None, None)
    ids = corpus_mod.eval_chunks(corpus_mod.tokenize(corpus, tok), args.context, 1)
    layers = capture(model, ids, args.every)
    print(f"Embedded model, 1 x {args.context} WikiText-2 test tokens, layers {sorted(layers)}, {threads} threads; "
          "relative attention-output error, every token quantized, one side at a time.\n")
    print("| format | bits/elem (codes + params) | keys only | values only |")
    print("|---|---|---|---|")
    for w in WIDTHS:
        q = QuantSpec(fmt="rot", bits=w)
        s = CacheSpec(key=q, value=q)
        print(f"| rot {w:g} | {bits_per_element(q, 64):.3f} | {side_error(layers, s, 'key'):.4f} | "
              f"{side_error(layers, s, 'value'):.4f} |", flush=True)
    for name in ("kivi-2", "kivi-3"):
        s = preset(name)
        print(f"| {name} | {bits_per_element(s.key, 64):.3f} | {side_error(layers, s, 'key'):.4f} | "
              f"{side_error(layers, s, 'value'):.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
