"""kvsqueeze export: fold an artifact's transforms into the model and write a plain transformers checkpoint."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv", required=True, help="calibration artifact directory with foldable transforms "
                                               "(kvsqueeze calibrate --method invertible)")
    p.add_argument("--folded", required=True, metavar="OUT_DIR",
                   help="where to write the folded checkpoint (config, safetensors, tokenizer)")
    p.add_argument("--model", default=None,
                   help="the model the artifact was calibrated on (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it is not empty")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    from kvsqueeze.artifact import is_artifact_dir
    from kvsqueeze.calibrate.export import ARTIFACT_SUBDIR, export_folded

    if not is_artifact_dir(args.kv):
        raise ValueError(f"--kv must be a calibration artifact directory, got {args.kv!r}")
    rec = export_folded(args.kv, args.folded, args.model, overwrite=args.overwrite, progress=not args.quiet)
    e = rec["logits_error"]
    print(f"kvsqueeze export: folded {rec['artifact']} into {rec['path']}")
    print(f"  reloaded with plain transformers: logits relative L2 error {e['relative_l2']:.2e}, max abs "
          f"{e['max_abs_relative']:.2e} of the largest logit ({rec['probe_tokens']} probe tokens)")
    print(f"  kvsqueeze cache for the folded model: --model {rec['path']} --kv {rec['path']}/{ARTIFACT_SUBDIR}")
    return 0
