"""kvsqueeze calibrate: run a model on calibration text and write a calibration artifact directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from . import _options


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvsqueeze.calibrate.methods import REGISTRY, options

    p.add_argument("--method", required=True, choices=list(REGISTRY),
                   help="; ".join(f"{k}: {m.help}" for k, m in REGISTRY.items()))
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
    # every method's settings, from the registry: the help says which methods take an option
    everyone = set(REGISTRY)
    for name, (f, methods) in options().items():
        if name == "seed":
            continue  # below: it also seeds --generated sampling
        md = f.metadata
        which = "" if set(methods) == everyone else f"{', '.join(methods)}: "
        help_text = (which + md["help"]).replace("%", "%%")
        flag = md["flag"] or "--" + name.replace("_", "-")
        if f.type in (bool, "bool"):
            p.add_argument(flag, dest=name, action="store_const", const=not md["negate"], default=None,
                           help=help_text)
        else:
            p.add_argument(flag, dest=name, type=md["type"], choices=md["choices"], default=None, help=help_text)
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
    from kvsqueeze.calibrate.api import calibrate
    from kvsqueeze.calibrate.collect import corpus_samples, generated_samples
    from kvsqueeze.calibrate.methods import get, options, settings_from
    from kvsqueeze.calibrate.requirements import check_model
    from kvsqueeze.eval import meta

    start = time.perf_counter()
    method = get(args.method)
    given = {name: getattr(args, name) for name in options() if name != "seed"}
    if "seed" in {f.name for f in method.fields()}:
        given["seed"] = args.seed
    settings = settings_from(args.method, given, cli=True)  # bad settings fail here, before the model is loaded
    corpus = None if args.generated else corpus_mod.resolve_corpus(args.text, args.dataset)
    model, tokenizer, threads = meta.load_for_eval(args.model, args.threads)
    # what the method needs of this model, checked before any text is generated or activation collected
    check_model(model, method.name, method.transform(settings))
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
