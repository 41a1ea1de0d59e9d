"""Quality of the vLLM plugin's page formats, emulated in transformers: K/V as the plugin's pages hold them.

For each format of :mod:`kvsqueeze.kernels.paged` (or those named), every attention layer of the model sees each
chunk's keys and values as the plugin stores them: 32-token pages encoded and decoded by the format
(``PagedFormat.encode`` / ``decode``; sink tokens exact, their page packed without them), every query reading every
position of its context, its own included, from the decoded pages.  That is the protocol of BENCHMARKS.md section
8's plugin table (vLLM prefills each 1024-token chunk in one step, 32 whole pages, and attention reads them packed).

Printed per format: perplexity, its change against the unquantized model on the same chunks, and the mean KL
divergence (nats per token) of the next-token distribution from the unquantized model's.  The KL is the steadier
reading: at 4 x 1024 tokens, formats whose KL differs by a quarter can swap order in perplexity.  Weights are fp32
here (vLLM runs bf16), so perplexities differ from vLLM's by that rounding: a screen for formats before a vLLM run
(``kvsqueeze ppl --kv vllm:kvsqueeze-<format>``), not a replacement for it.

    KVSQUEEZE_DATA=../shared/data PYTHONPATH=src python benchmarks/paged_formats.py --threads 2 --context 1024 --chunks 4
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from kvsqueeze.eval import benchkit

PAGE = 32  # tokens per page (the plugin's vLLM block size)


def paged_kv(fmt, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [B, H, T, D] (T a multiple of PAGE) as the plugin's pages return them, in k's dtype."""
    b, h, t, d = k.shape
    kf, vf = k.float(), v.float()
    s = fmt.sinks
    if s:  # the first page is packed with its sinks replaced by the token after them; the sinks are read exactly
        sink_k, sink_v = kf[:, :, :s].clone(), vf[:, :, :s].clone()
        kf, vf = kf.clone(), vf.clone()
        kf[:, :, :s], vf[:, :, :s] = kf[:, :, s:s + 1], vf[:, :, s:s + 1]

    def pages(x):  # [B, H, T, D] -> [B * T / PAGE, H, PAGE, D]
        return x.reshape(b, h, t // PAGE, PAGE, d).transpose(1, 2).reshape(-1, h, PAGE, d)

    def back(x):
        return x.reshape(b, t // PAGE, h, PAGE, d).transpose(1, 2).reshape(b, h, t, d)

    dk, dv = fmt.decode(fmt.encode(pages(kf), pages(vf)), PAGE, d)
    dk, dv = back(dk), back(dv)
    if s:
        dk[:, :, :s], dv[:, :, :s] = sink_k, sink_v
    return dk.to(k.dtype), dv.to(v.dtype)


def score(model, chunks: torch.Tensor, reference: list[torch.Tensor] | None) -> tuple[float, float, list]:
    """(perplexity over targets 1.. of each chunk, mean KL from ``reference`` per token, and the log-probabilities
    when there is no reference: the unquantized pass's, kept as the reference, ~200 MB per 1024-token chunk)."""
    nll = kl = 0.0
    n = 0
    logps = []
    with torch.no_grad():
        for i, row in enumerate(chunks):
            logp = model(row[None].to(model.device)).logits[0, :-1].float().log_softmax(-1)
            nll -= logp.gather(1, row[1:, None].to(logp.device)).sum().item()
            if reference is not None:
                kl += (reference[i].exp() * (reference[i] - logp)).sum().item()
            n += row.numel() - 1
            if reference is None:
                logps.append(logp)
    return math.exp(nll / n), kl / n, logps


def main(argv: list[str] | None = None) -> int:
    from kvsqueeze.adapter import attention_override, sdpa_attention_forward
    from kvsqueeze.corpus import eval_chunks, resolve_corpus, summary, tokenize
    from kvsqueeze.kernels.paged import FORMATS, paged_format

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    benchkit.add_common_args(p, threads=None)
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS), metavar="FORMAT",
                   help=f"page formats (default: every one; allowed: {', '.join(FORMATS)})")
    p.add_argument("--context", type=int, default=1024, help="tokens per chunk (a multiple of 32)")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--dataset", default=None, help="corpus (default: WikiText-2 where found, as every script)")
    args = p.parse_args(argv)
    if args.context % PAGE:
        p.error(f"--context must be a multiple of the page's {PAGE} tokens, got {args.context}")
    fmts = [paged_format(name) for name in args.formats]
    model, tokenizer, threads = benchkit.load(args)
    corpus = resolve_corpus(dataset=args.dataset)
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    chunks = eval_chunks(tokenize(corpus, tokenizer), args.context, args.chunks)
    print(f"paged_formats: {args.chunks} x {args.context} tokens; {summary(corpus)}", flush=True)
    print(benchkit.machine_line(threads), flush=True)

    t0 = time.perf_counter()
    base, _, reference = score(model, chunks, None)
    rows = [{"format": "unquantized", "bits_per_element": 32.0, "ppl": base, "kl": 0.0,
             "seconds": time.perf_counter() - t0}]
    for fmt in fmts:
        def attention(module, query, key, value, attention_mask, fmt=fmt, **kw):
            k, v = paged_kv(fmt, key, value)
            return sdpa_attention_forward(module, query, k, v, attention_mask, **kw)

        t0 = time.perf_counter()
        with attention_override(model, attention):
            ppl, kl, _ = score(model, chunks, reference)
        rows.append({"format": fmt.name, "bits_per_element": fmt.bits_per_element(PAGE, head_dim), "ppl": ppl,
                     "kl": kl, "seconds": time.perf_counter() - t0})

    write_rows(rows, "page format | bits/element (in the pool)", args, threads, summary(corpus))
    return 0


def write_rows(rows: list[dict], columns: str, args: argparse.Namespace, threads: int, corpus: str) -> None:
    """The table of ``rows`` (the first the unquantized reference) under ``columns`` (the first two headers), and
    the JSON record where ``--json`` asks for one."""
    base = rows[0]["ppl"]
    print(f"\n| {columns} | ppl | vs unquantized | KL nats/token |")
    print("|---|---|---|---|---|")
    for r in rows:
        change = "—" if r["format"] == "unquantized" else f"{100 * (r['ppl'] / base - 1):+.2f}%"
        print(f"| {r['format']} | {r['bits_per_element']:.3f} | {r['ppl']:.4f} | {change} | {r['kl']:.5f} |")
    if args.json:
        benchkit.write_json(args.json, {"machine": benchkit.machine_block(threads), "context": args.context,
                                        "chunks": args.chunks, "corpus": corpus, "rows": rows})


if __name__ == "__main__":
    raise SystemExit(main())
