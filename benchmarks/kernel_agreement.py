"""Does the C++ kernel change what a model generates?  Greedy decoding, C++ kernel vs the pure-torch reference.

For each preset and each instruction-set path of the C++ kernel this CPU runs (``avx512-vbmi``, ``avx512-vnni`` and
``avx2`` score integer keys by integer dot products with a query rounded to ~15 bits, ``avx512-vbmi`` also rotated
keys with levels and query rounded to 13-14 bits, the two AVX-512 paths weight 2/4-bit per-token values with weights
rounded to 16 bits; ``generic`` is float only), the embedded
model generates ``--steps`` greedy tokens after a WikiText-2 prompt of ``--prompt`` tokens (so most of the context is
stored quantized, past the 128-token window), once with ``backend="cpu"`` and once with the reference
(``backend="torch"``) over the same codes.  Printed per preset and path: the tokens that agree, the first
divergence, and the largest logit difference up to it beside the largest logit difference between the reference
and the unquantized ``full`` cache (the preset's own error), which is the bound the kernel's difference is judged
against.  Per step, over the same codes, the kernel and the reference agree to float rounding (or the integer
path's bound, tests/kernels); presets without a window quantize each new token from hidden states that already
differ at that level, so a code can round the other way and the logits then differ by up to the preset's own error.

    KVSQUEEZE_DATA=../shared/data PYTHONPATH=src python benchmarks/kernel_agreement.py --threads 2
"""

from __future__ import annotations

import argparse

import torch

PRESETS = ("int8", "int4", "int2", "kivi-4", "kivi-2", "kivi-2-sink4", "rot-3")


def greedy(model, ids: torch.Tensor, spec, backend: str, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(new tokens [steps], logits [steps, vocab]) of greedy decoding with a kvsqueeze cache."""
    from kvsqueeze.adapter import QuantizedCache, cache_kwargs

    cache = QuantizedCache(model.config, spec, backend=backend)
    out = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, ids.shape[1]:], torch.stack(out.logits)[:, 0].float()


def integer_paths(spec, head_dim: int) -> str:
    """Whether the selected path scores the keys and weights the values by integer dot products, "keys / values":
    yes / no each, or "k of n layers" for an artifact whose layers have their own formats."""
    from kvsqueeze.kernels import cpu
    from kvsqueeze.quant.format import storage_format

    sides = spec.layer_overrides or [(spec.key, spec.value)]

    def count(served, i: int) -> str:
        hits = sum(served(storage_format(side[i], head_dim, torch.float32)) for side in sides)
        return ("yes" if hits else "no") if len(sides) == 1 else f"{hits} of {len(sides)} layers"

    return f"{count(cpu.integer_key_format, 0)} / {count(cpu.integer_value_format, 1)}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (WikiText-2 test, from its start)")
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--presets", nargs="+", default=list(PRESETS),
                   help="presets, spec strings or calibration artifact directories (for --model)")
    p.add_argument("--model", default=None, help="Hugging Face directory or .gguf file (default: the embedded model)")
    p.add_argument("--isa", nargs="+", default=None, help="C++ kernel paths (default: every path this CPU runs)")
    args = p.parse_args(argv)
    from kvsqueeze.corpus import resolve_corpus
    from kvsqueeze.errors import KvsqueezeError
    from kvsqueeze.eval.benchkit import load
    from kvsqueeze.kernels import cpu
    from kvsqueeze.resolve import resolve_cache_spec

    try:
        specs = {name: resolve_cache_spec(name, "kernel_agreement.py") for name in args.presets}
    except KvsqueezeError as err:  # before the model loads: one line naming what is allowed
        raise SystemExit(f"kernel_agreement.py: {err}") from None
    model, tok, _ = load(args)
    text = resolve_corpus().text
    text_cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
    ids = tok(text[: args.prompt * 8], return_tensors="pt").input_ids[:, : args.prompt]
    isas = [i for i in (args.isa or cpu.runnable_isas()) if i in cpu.runnable_isas()]
    print(f"## C++ kernel vs reference: {args.model or 'embedded model'}, {ids.shape[1]}-token WikiText-2 prompt, {args.steps} greedy "
          f"steps, {torch.get_num_threads()} threads; paths: {', '.join(isas)}\n")
    print("| preset | path | integer keys / values | tokens equal | first divergence "
          "| max logit diff (kernel - reference) | max logit diff (reference - full) |")
    print("|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        full_tokens, full_logits = greedy(model, ids, "full", "torch", args.steps)
        for spec in args.presets:
            ref_tokens, ref_logits = greedy(model, ids, specs[spec], "torch", args.steps)
            same_as_full = int((ref_tokens == full_tokens).cumprod(0).sum())
            own = (ref_logits[:same_as_full] - full_logits[:same_as_full]).abs().max().item() if same_as_full else 0.0
            for isa in isas:
                with cpu.use_isa(isa):
                    got_tokens, got_logits = greedy(model, ids, specs[spec], "cpu", args.steps)
                    integer = integer_paths(specs[spec], head_dim)
                agree = int((got_tokens == ref_tokens).cumprod(0).sum())
                first = "none" if agree == args.steps else str(agree)
                diff = (got_logits[:agree] - ref_logits[:agree]).abs().max().item() if agree else float("nan")
                print(f"| {spec} | {isa} | {integer} | {agree}/{args.steps} | {first} | {diff:.2e} | "
                      f"{own:.2e} (first {same_as_full} tokens equal to full's) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
