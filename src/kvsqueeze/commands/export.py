"""kvsqueeze export: fold an artifact's transforms into the model and write a plain transformers checkpoint."""

from __future__ import annotations

import argparse

from . import _options


def add_arguments(p: argparse.ArgumentParser) -> None:
    _options.add_kv(p, help="calibration artifact directory with foldable transforms (kvsqueeze calibrate "
                            "--method invertible), or the folder kvsqueeze calibrate --out wrote it into")
    p.add_argument("--folded", required=True, metavar="OUT_DIR",
                   help="where to write the folded checkpoint (config, safetensors, tokenizer)")
    _options.add_model(p, help="the model the artifact was calibrated on (default: the embedded "
                               "SmolLM2-135M-Instruct)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it is not empty")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    from kvsqueeze.calibrate.export import ARTIFACT_SUBDIR, export_folded
    from kvsqueeze.errors import UnsupportedCacheError

    kv = _options.resolve_kv_option(args.kv)  # the one resolver: a folder holding one artifact is accepted too
    artifact = getattr(kv, "meta", {}).get("artifact")
    if artifact is None:
        raise UnsupportedCacheError(f"--kv must be a calibration artifact directory (kvsqueeze calibrate --method "
                                    f"invertible), got {args.kv!r}")
    rec = export_folded(artifact, args.folded, args.model, overwrite=args.overwrite, progress=not args.quiet)
    e = rec["logits_error"]
    print(f"kvsqueeze export: folded {rec['artifact']} into {rec['path']}")
    print(f"  reloaded with plain transformers: logits relative L2 error {e['relative_l2']:.2e}, max abs "
          f"{e['max_abs_relative']:.2e} of the largest logit ({rec['probe_tokens']} probe tokens)")
    print(f"  kvsqueeze cache for the folded model: --model {rec['path']} --kv {rec['path']}/{ARTIFACT_SUBDIR}")
    return 0
