"""llama.cpp's KV cache formats beside kvsqueeze's, emulated in transformers: perplexity and KL, every token quantized.

Why: on 4 x 1024 WikiText-2 tokens real llama.cpp and kvsqueeze's caches land within a fraction of a percent of
each other at 4.5 and 6.5 bits (BENCHMARKS.md section 8), closer than perplexity over 4092 tokens can order.  The
mean KL divergence of the next-token distribution from the unquantized model's orders such formats; it needs both
sides' log-probabilities on the same model, so llama.cpp's formats are emulated here on the K/V of the embedded
model (fp32), every layer, every token (the all-quantized protocol, as llama.cpp stores its cache):

* ``llamacpp-<k>[-<v>]`` with ``<k>``/``<v>`` in q8_0, q4_0: ggml's blocks of 32 channels per token - q8_0: a
  scale d = max|x| / 127 and codes round(x / d); q4_0: d = m / -8, m the block's value of the largest magnitude
  (sign kept), and codes min(15, floor(x / d + 8.5)) - 8; the codes from the float d, d stored in fp16 (ggml's
  reference quantizers, which tests/engines/test_llamacpp_peer.py checks this against bit for bit).  ``-rot``
  rotates every token's K (and the query, which the rotation leaves exact) and V by the 64 x 64 Hadamard matrix
  first, as the llama.cpp that llama-cpp-python 0.3.36 vendors does for a quantized cache
  (``LLAMA_ATTN_ROT_DISABLE=1``: not).
* any kvsqueeze cache (a preset or spec string): its own codecs through the all-quantized protocol
  (:func:`kvsqueeze.eval.protocols.all_quantized_attend`, per-channel groups quantized causally).

    KVSQUEEZE_DATA=../shared/data PYTHONPATH=src python benchmarks/llamacpp_formats.py --threads 2 \\
        --formats llamacpp-q8_0-q4_0-rot k8t64-v4t32-w0 llamacpp-q4_0-rot k4rc128-v4r-w0
"""

from __future__ import annotations

import argparse
import re
import time

import torch
from paged_formats import score, write_rows  # a sibling script: its folder is sys.path[0] when run

from kvsqueeze.eval import benchkit

BLOCK = 32  # ggml's block of channels per token
_LLAMACPP = re.compile(r"^llamacpp-(q8_0|q4_0)(?:-(q8_0|q4_0))?(-rot)?$")


def ggml_roundtrip(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x [..., D] stored as ggml's ``kind`` (q8_0 / q4_0) over blocks of 32 channels and read back (fp32)."""
    g = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    if kind == "q8_0":
        d = g.abs().amax(-1, keepdim=True) / 127
    else:
        d = g.gather(-1, g.abs().argmax(-1, keepdim=True)) / -8
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))  # the codes from the float scale, as ggml computes them
    y = g * inv
    if kind == "q8_0":  # roundf: halves away from zero
        codes = torch.sign(y) * torch.floor(y.abs() + 0.5)
    else:
        codes = torch.clamp(torch.floor(y + 8.5), max=15) - 8
    return (codes * d.half().float()).reshape(x.shape).to(x.dtype)  # read back with the stored fp16 scale


def llamacpp_attention(name: str):
    """An attention function storing K/V as llama.cpp's format ``name`` does (see the module docstring)."""
    from kvsqueeze.adapter import sdpa_attention_forward
    from kvsqueeze.transforms.matrices import hadamard

    m = _LLAMACPP.match(name)
    kind_k, kind_v, rot = m.group(1), m.group(2) or m.group(1), bool(m.group(3))

    def attention(module, query, key, value, attention_mask, **kw):
        if rot:  # q k^T is unchanged by an orthonormal rotation of both; values are rotated back after attention
            h = hadamard(key.shape[-1]).to(key.dtype)
            out, w = sdpa_attention_forward(module, query @ h, ggml_roundtrip(key @ h, kind_k),
                                            ggml_roundtrip(value @ h, kind_v), attention_mask, **kw)
            return out @ h.T, w
        return sdpa_attention_forward(module, query, ggml_roundtrip(key, kind_k), ggml_roundtrip(value, kind_v),
                                      attention_mask, **kw)

    return attention


def kvsqueeze_attention(spec_name: str, head_dim: int):
    """kvsqueeze's all-quantized protocol for ``spec_name`` on every layer (the embedded model has no sliding
    layers)."""
    from kvsqueeze.eval.protocols import all_quantized_attend
    from kvsqueeze.spec import preset

    spec = preset(spec_name)
    spec.check_head_dim(head_dim)

    def attention(module, query, key, value, attention_mask, scaling=None, **kw):
        s = query.shape[-1] ** -0.5 if scaling is None else scaling
        out = all_quantized_attend(query, key, value, attention_mask, s, spec, kw.get("softcap"))
        return out.transpose(1, 2).contiguous(), None

    return attention, spec


def bits(name: str, spec, head_dim: int) -> float:
    if spec is not None:
        from kvsqueeze.quant import bits_per_element

        return (bits_per_element(spec.key, head_dim) + bits_per_element(spec.value, head_dim)) / 2
    m = _LLAMACPP.match(name)
    per = {"q8_0": 8.5, "q4_0": 4.5}  # 32 codes and an fp16 scale per block
    return (per[m.group(1)] + per[m.group(2) or m.group(1)]) / 2


def main(argv: list[str] | None = None) -> int:
    from kvsqueeze.adapter import attention_override
    from kvsqueeze.corpus import eval_chunks, resolve_corpus, summary, tokenize
    from kvsqueeze.layout import kv_layout

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    benchkit.add_common_args(p, threads=None)
    p.add_argument("--formats", nargs="+", required=True, metavar="FORMAT",
                   help="llamacpp-<q8_0|q4_0>[-<q8_0|q4_0>][-rot] (keys, then values; -rot: llama.cpp's Hadamard "
                        "rotation) or a kvsqueeze preset / spec string")
    p.add_argument("--context", type=int, default=1024, help="tokens per chunk")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--dataset", default=None, help="corpus (default: WikiText-2 where found, as every script)")
    args = p.parse_args(argv)
    for name in args.formats:
        if name.startswith("llamacpp") and not _LLAMACPP.match(name):
            p.error(f"{name!r} is not llamacpp-<q8_0|q4_0>[-<q8_0|q4_0>][-rot]")
    model, tokenizer, threads = benchkit.load(args)
    head_dim = kv_layout(model.config).head_dim
    attends = {}
    for name in args.formats:  # every name checked before the long passes
        attends[name] = ((llamacpp_attention(name), None) if name.startswith("llamacpp")
                         else kvsqueeze_attention(name, head_dim))
    corpus = resolve_corpus(dataset=args.dataset)
    chunks = eval_chunks(tokenize(corpus, tokenizer), args.context, args.chunks)
    print(f"llamacpp_formats: {args.chunks} x {args.context} tokens; {summary(corpus)}", flush=True)
    print(benchkit.machine_line(threads), flush=True)
    base, _, reference = score(model, chunks, None)
    rows = [{"format": "unquantized", "bits_per_element": 32.0, "ppl": base, "kl": 0.0}]
    for name, (attention, spec) in attends.items():
        t0 = time.perf_counter()
        with attention_override(model, attention):
            ppl, kl, _ = score(model, chunks, reference)
        rows.append({"format": name, "bits_per_element": bits(name, spec, head_dim), "ppl": ppl, "kl": kl,
                     "seconds": time.perf_counter() - t0})
        print(f"  {name}: ppl {ppl:.4f}, KL {kl:.5f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    write_rows(rows, "format | bits/element", args, threads, summary(corpus))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
