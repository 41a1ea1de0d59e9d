"""kvsqueeze export: fold an artifact into the model's weights and write a plain transformers checkpoint
(``--folded``) or a checkpoint vLLM serves with calibrated fp8 KV scales (``--vllm``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import _options


def add_arguments(p: argparse.ArgumentParser) -> None:
    _options.add_kv(p, help="calibration artifact directory (kvsqueeze calibrate --method invertible for --folded, "
                            "--method vllm-fp8 for --vllm), or the folder kvsqueeze calibrate --out wrote it into")
    dest = p.add_mutually_exclusive_group(required=True)
    dest.add_argument("--folded", metavar="OUT_DIR",
                      help="where to write the folded checkpoint (config, safetensors, tokenizer)")
    dest.add_argument("--vllm", metavar="OUT_DIR",
                      help="where to write a checkpoint vLLM loads unchanged: folded weights, compressed-tensors "
                           "kv_cache_scheme and per-layer k_scale/v_scale (checked in vLLM when it is installed)")
    _options.add_model(p, help="the model the artifact was calibrated on (default: the embedded "
                               "SmolLM2-135M-Instruct)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it is not empty")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    from kvsqueeze.errors import UnsupportedCacheError

    kv = _options.resolve_kv_option(args.kv)  # the one resolver: a folder holding one artifact is accepted too
    artifact = getattr(kv, "meta", {}).get("artifact")
    if artifact is None:
        raise UnsupportedCacheError(f"--kv must be a calibration artifact directory (kvsqueeze calibrate --method "
                                    f"{'vllm-fp8' if args.vllm else 'invertible'}), got {args.kv!r}")
    if args.vllm:
        return _run_vllm(args, artifact)
    from kvsqueeze.calibrate.export import ARTIFACT_SUBDIR, export_folded

    rec = export_folded(artifact, args.folded, args.model, overwrite=args.overwrite, progress=not args.quiet)
    e = rec["logits_error"]
    print(f"kvsqueeze export: folded {rec['artifact']} into {rec['path']}")
    print(f"  reloaded with plain transformers: logits relative L2 error {e['relative_l2']:.2e}, max abs "
          f"{e['max_abs_relative']:.2e} of the largest logit ({rec['probe_tokens']} probe tokens)")
    print(f"  kvsqueeze cache for the folded model: --model {rec['path']} --kv {rec['path']}/{ARTIFACT_SUBDIR}")
    return 0


def _run_vllm(args: argparse.Namespace, artifact: str) -> int:
    from kvsqueeze.calibrate.export_vllm import export_vllm
    from kvsqueeze.external import vllm_client

    # export_vllm refuses what vLLM cannot represent in one line, before the model is loaded
    check = _vllm_check if vllm_client.vllm_python() is not None else None
    rec = export_vllm(artifact, args.vllm, args.model, overwrite=args.overwrite, progress=not args.quiet, check=check)
    e, u = rec["logits_error"], rec["unquantized_change"]
    print(f"kvsqueeze export: {rec['artifact']} -> {rec['path']} (fp8 {rec['fp8_format']}, per-layer k_scale / "
          f"v_scale, compressed-tensors kv_cache_scheme)")
    print(f"  reloaded with plain transformers: logits relative L2 error {e['relative_l2']:.2e} vs the folded "
          f"model ({rec['probe_tokens']} probe tokens); folded compensations move unquantized logits by "
          f"{u['relative_l2']:.2e} (relative L2)")
    c = rec.get("vllm_check")
    if c is None:
        print("  vLLM check skipped: vLLM is not installed (" + vllm_client.PYTHON_ENV + ")")
    else:
        print(f"  vLLM {c['vllm_version']} loaded it with kv_cache_dtype={c['kv_cache_dtype']}: probe NLL "
              f"{c['vllm_nll_mean']:.4f} vs {c['transformers_nll_mean']:.4f} in transformers (fp32)"
              + (f"; {c['note']}" if c.get("note") else ""))
    print(f"  serve: vllm serve {rec['path']} --kv-cache-dtype fp8_{rec['fp8_format']}")
    return 0


def _vllm_check(path: Path, ids: list[int]) -> dict[str, Any]:
    """Load the staged checkpoint in vLLM with its fp8 cache (or, where vLLM's fp8 cache cannot run on this CPU,
    with its unquantized cache) and compare the probe's NLL with transformers'."""
    import json
    import tempfile

    import torch

    from kvsqueeze.calibrate.export_vllm import reload_plain
    from kvsqueeze.external import vllm_client

    fmt = json_fp8_format(path)
    note = ""
    try:
        res = vllm_client.prompt_nll(path, f"fp8_{fmt}", [ids])
        dtype = f"fp8_{fmt}"
    except vllm_client.VllmError as exc:
        if "AVX-512" not in str(exc):
            raise
        if exc.log is not None:  # an expected refusal: its log is not worth keeping
            exc.log.unlink(missing_ok=True)
        # a kv_cache_scheme makes vLLM use its fp8 cache whatever kv_cache_dtype says: check the weights through a
        # copy without it, in vLLM's unquantized cache
        note = ("vLLM's fp8 cache needs AVX-512 or AMX on a CPU, which this one lacks: the weights were checked "
                "without the kv_cache_scheme, in vLLM's unquantized cache")
        with tempfile.TemporaryDirectory(prefix=".vllm-check-", dir=path.parent) as tmp:
            plain = Path(tmp)
            from safetensors.torch import load_file, save_file

            for f in path.iterdir():
                if f.suffix == ".safetensors":  # without the scale tensors, which only the scheme declares
                    w = {k: t for k, t in load_file(str(f)).items() if not k.endswith(("k_scale", "v_scale"))}
                    save_file(w, str(plain / f.name), metadata={"format": "pt"})
                elif f.name != "config.json":
                    (plain / f.name).symlink_to(f.resolve())
            cfg = json.loads((path / "config.json").read_text())
            cfg.pop("quantization_config", None)
            (plain / "config.json").write_text(json.dumps(cfg))
            res = vllm_client.prompt_nll(plain, "auto", [ids])
        dtype = "auto"
    model = reload_plain(path, torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
    ref = -logp.gather(1, torch.tensor(ids[1:])[:, None]).mean()
    vllm_nll = sum(res["nll"][0]) / len(res["nll"][0])
    return {"vllm_version": res["vllm_version"], "kv_cache_dtype": dtype, "vllm_nll_mean": vllm_nll,
            "transformers_nll_mean": float(ref), "note": note}


def json_fp8_format(path: Path) -> str:
    import json

    return json.loads((path / "config.json").read_text())["quantization_config"]["kvsqueeze"]["fp8_format"]
