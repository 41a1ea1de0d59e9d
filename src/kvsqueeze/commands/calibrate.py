"""kvsqueeze calibrate: run a model on calibration text and write a calibration artifact directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from . import _options


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvsqueeze.calibrate.api import METHOD_HELP, METHODS
    from kvsqueeze.calibrate.clip import CLIP_MODES
    from kvsqueeze.calibrate.invertible import GROUPINGS, TRANSFORM_HELP

    p.add_argument("--method", required=True, choices=METHODS,
                   help="; ".join(f"{k}: {v}" for k, v in METHOD_HELP.items()))
    _options.add_model(p)
    src = p.add_mutually_exclusive_group()
    _options.add_corpus(src, "calibration corpus (its last 10%% is used)")
    src.add_argument("--generated", action="store_true", help="calibrate on text the model samples itself")
    p.add_argument("--samples", type=int, default=4, help="calibration sequences (default 4)")
    p.add_argument("--length", type=int, default=512, help="tokens per sequence (default 512)")
    p.add_argument("--start-fraction", type=float, default=None,
                   help="where the calibration slice starts in the corpus tokens (default 0.9: the tail that "
                        "kvsqueeze ppl never evaluates); earlier starts need --allow-overlap")
    p.add_argument("--allow-overlap", action="store_true",
                   help="accept a calibration slice overlapping the evaluation chunks (recorded in the artifact)")
    p.add_argument("--key-bits", type=int, default=None, help="key code bits (default 2; 4 for invertible)")
    p.add_argument("--value-bits", type=float, default=None,
                   help="value bits: 1.5 (ternary, docs/calibrated.md), 1, 2, 3, 4, 8 (default: 1.5 for skvq and "
                        "hybrid, the key bits for kvquant and invertible)")
    p.add_argument("--key-group", type=int, default=None,
                   help="key group size (default 32; invertible: 64 for --grouping token, in tokens for kivi)")
    p.add_argument("--value-group", type=int, default=None, help="value group size in channels (default 32; "
                                                                  "invertible --grouping token: 64)")
    p.add_argument("--param-dtype", default=None, choices=["fp8-e4m3", "fp16", "bf16", "fp32"],
                   help="dtype of group scales/zeros (default fp8-e4m3 as SKVQ; invertible token/kivi: fp16)")
    p.add_argument("--transform", default="learned-folded", choices=list(TRANSFORM_HELP),
                   help="invertible: " + "; ".join(f"{k}: {v}" for k, v in TRANSFORM_HELP.items()))
    p.add_argument("--grouping", default="token", choices=GROUPINGS,
                   help="invertible: the quantizer behind the transform - per-token groups (default), kivi "
                        "(per-channel keys, per-token values) or skvq (reorder + clip search)")
    p.add_argument("--steps", type=int, default=150, help="invertible: Adam steps per layer (default 150)")
    p.add_argument("--rank", type=int, default=8, help="invertible: rank of the Woodbury updates (default 8)")
    p.add_argument("--no-reorder", action="store_true", help="SKVQ without channel reordering (ablation)")
    p.add_argument("--clip", default="layer", choices=CLIP_MODES,
                   help="clip-ratio search granularity (default layer; none = plain RTN ranges)")
    p.add_argument("--outliers", type=int, default=1,
                   help="KVQuant keys: channels per token and head kept exactly (default 1 = 1/64 of values)")
    p.add_argument("--nuq", action="store_true", help="KVQuant keys: non-uniform per-layer codebooks")
    p.add_argument("--fp8-format", default="e4m3", choices=["e4m3", "e5m2"],
                   help="vllm-fp8: the fp8 format vLLM will serve with (--kv-cache-dtype fp8_e4m3 or fp8_e5m2)")
    p.add_argument("--rounding", default="truncate", choices=["truncate", "nearest"],
                   help="vllm-fp8: how the serving vLLM converts to fp8 (truncate: its CPU kernels; nearest: "
                        "round-to-nearest-even kernels)")
    p.add_argument("--no-compensation", action="store_true",
                   help="vllm-fp8: scales only, no compensation of the fp8 conversion's bias")
    p.add_argument("--no-key-rotation", action="store_true",
                   help="vllm-fp8: no RoPE-pair rotations of the keys (folded into W_q/W_k on export)")
    p.add_argument("--window", type=int, default=128, help="full-precision window of the artifact (default 128)")
    p.add_argument("--sinks", type=int, default=4, help="full-precision sink tokens (default 4)")
    p.add_argument("--out", required=True, help="parent folder: the artifact is written to OUT/<name of settings> "
                                                "(--kv OUT then finds it while it is the only one there)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing artifact of the same name")
    _options.add_threads(p)
    p.add_argument("--seed", type=int, default=0,
                   help="seed of --generated sampling and of the invertible method's initialisation (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    import time

    from kvsqueeze import corpus as corpus_mod
    from kvsqueeze.calibrate.api import CalibrationSettings, calibrate, method_defaults
    from kvsqueeze.calibrate.collect import corpus_samples, generated_samples
    from kvsqueeze.calibrate.requirements import check_model
    from kvsqueeze.eval import meta

    start = time.perf_counter()
    dflt = method_defaults(args.method, args.grouping)

    def pick(name: str):
        v = getattr(args, name)
        return dflt[name] if v is None else v

    key_bits = pick("key_bits")
    value_bits = args.value_bits if args.value_bits is not None else (
        float(key_bits) if args.method in ("kvquant", "invertible") else 1.5)
    settings = CalibrationSettings(  # bad settings fail here, before the model is loaded
        method=args.method, key_bits=key_bits, value_bits=value_bits, key_group=pick("key_group"),
        value_group=pick("value_group"), param_dtype=pick("param_dtype"), reorder=not args.no_reorder, clip=args.clip,
        outliers=args.outliers, nuq=args.nuq, window=args.window, sinks=args.sinks, transform=args.transform,
        grouping=args.grouping, steps=args.steps, rank=args.rank, seed=args.seed, fp8_format=args.fp8_format,
        rounding=args.rounding, compensate=not args.no_compensation, rotate_keys=not args.no_key_rotation)
    corpus = None if args.generated else corpus_mod.resolve_corpus(args.text, args.dataset)
    model, tokenizer, threads = meta.load_for_eval(args.model, args.threads)
    # what the method needs of this model, checked before any text is generated or activation collected
    check_model(model, settings.method, settings.transform if settings.method == "invertible" else None)
    progress = not args.quiet
    if corpus is None:
        data = generated_samples(model, tokenizer, args.samples, args.length, seed=args.seed, progress=progress)
    else:
        data = corpus_samples(corpus, tokenizer, args.samples, args.length, args.start_fraction, args.allow_overlap)
    model_name = Path(args.model).stem if args.model else "smollm2-135m"
    art = calibrate(model, data, settings, model_name=model_name, progress=progress)
    art.calibration["command"] = meta.command_line(args)
    art.calibration["threads"] = threads
    path = art.save(args.out, overwrite=args.overwrite)
    src = data.provenance
    print(f"kvsqueeze calibrate: {settings.method} on {src['samples']} x {src['length']} tokens "
          f"({src['source']}{', sha256 ' + src['sha256'][:12] if 'sha256' in src else ''}) "
          f"in {time.perf_counter() - start:.1f} s")
    print(f"wrote {path}  (use it as --kv {path})")
    return 0
