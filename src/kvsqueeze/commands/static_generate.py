"""kvsqueeze static-generate: greedy generation on ONNX Runtime through the static-shape KV manager.

The model's prefill and one-token decode steps are exported once to ONNX with static shapes (cached under
``--onnx-dir``); the manager's buffers are the engine's K/V inputs and outputs.  Streams the text, then prints
one line: decode tokens/s, window copies, bytes moved and requantizations (always 0: codes are only moved).
"""

from __future__ import annotations

import argparse
import sys

from . import _options

KV_CHOICES = ("float", "int8-static", "int4-static")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--max-len", type=int, default=256, metavar="S",
                   help="static max sequence length S: the past window is S-1 tokens (default 256)")
    p.add_argument("--kv", choices=KV_CHOICES, default="float",
                   help="K/V storage: float32, or codes with fixed calibrated scale/zero-point (default float)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    _options.add_model(p)
    p.add_argument("--onnx-dir", default=None,
                   help="folder of exported graphs; created when empty (default ~/.cache/kvsqueeze/onnx/"
                        "<model-hash>-<S>-<kv>, re-exported when the settings change)")
    p.add_argument("--reserve", type=float, choices=(2.0, 1.5), default=2.0,
                   help="buffer slots per K/V as a multiple of S-1: 2 (a copy per S-1 tokens) or 1.5 (less memory)")
    p.add_argument("--on-full", choices=("stop", "slide"), default="stop",
                   help="when prompt + generated reaches S: stop with a message, or slide the window (the model then "
                        "sees only the last S-1 tokens)")
    p.add_argument("--calib-text", default=None, metavar="FILE",
                   help="calibration text for the int*-static formats (default: last 10%% of "
                        "$KVSQUEEZE_DATA/wikitext-2-raw/wiki.test.raw, else a built-in paragraph)")
    p.add_argument("--calib-method", choices=("absmax", "percentile"), default="absmax")
    p.add_argument("--granularity", choices=("channel", "tensor"), default="channel",
                   help="one scale/zero-point per layer, KV head and channel, or per layer")
    p.add_argument("--symmetric", action="store_true", help="symmetric codes (int8 / zero-point 8 for int4)")
    p.add_argument("--layout", choices=("token", "head"), default="token",
                   help="buffer layout: token-major (zero-copy for any batch) or the graph's [B, H, S-1, D]")
    p.add_argument("--private-weights", action="store_true",
                   help="let each ONNX Runtime session load and prepack its own copy of the weights (faster "
                        "MatMuls, about twice the memory); default: one memory-mapped copy shared by both graphs")
    p.add_argument("--raw", action="store_true", help="do not wrap the prompt in the model's chat template")
    _options.add_threads(p)  # ONNX Runtime's intra-op threads too


def run(args: argparse.Namespace) -> int:
    if args.max_len < 2:
        raise ValueError(f"--max-len must be at least 2, got {args.max_len}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    from kvsqueeze.engines.onnx_runner import require_onnxruntime
    from kvsqueeze.errors import MissingDependencyError

    require_onnxruntime()  # a missing extra fails before the model loads
    try:
        import onnx  # noqa: F401  (the exporter needs it)
    except ImportError as exc:
        raise MissingDependencyError('the ONNX Runtime path needs onnx and onnxruntime: pip install -e ".[onnx]"'
                                     ) from exc

    from kvsqueeze.models import load_model, set_threads

    threads = set_threads(args.threads)
    model, tok = load_model(args.model, progress=False)
    prompt_ids = _prompt_ids(tok, args.prompt, args.raw)
    from kvsqueeze.engines.static_generation import check_prompts

    check_prompts([prompt_ids], 1, args.max_len)  # too long a prompt fails before any export
    folder = _graphs(model, tok, args)

    from kvsqueeze.engines.onnx_export import model_fingerprint
    from kvsqueeze.engines.onnx_runner import OrtStaticEngine
    from kvsqueeze.engines.static_generation import greedy_generate

    engine = OrtStaticEngine(folder, fingerprint=model_fingerprint(model), threads=threads,
                             share_weights=not args.private_weights)
    manager = engine.make_manager(args.reserve, on_full=args.on_full)
    printed = [""]
    generated: list[int] = []

    def stream(tok_ids) -> None:
        generated.append(int(tok_ids[0]))
        text = tok.decode(generated, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(printed[0]):])
            sys.stdout.flush()
            printed[0] = text

    res = greedy_generate(engine, manager, [prompt_ids], args.max_new_tokens, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id or 0, on_token=stream)
    print()
    if res.stopped not in ("eos", "max_new_tokens"):
        print(f"kvsqueeze static-generate: {res.stopped}", file=sys.stderr)
    st = res.stats
    print(f"tokens/s={res.decode_tokens_per_s:.2f} (decode, onnxruntime CPU, {threads} threads, "
          f"{res.decode_steps} steps; prefill {res.prefill_s * 1000:.0f} ms) generated={len(res.tokens[0])} "
          f"kv={args.kv} S={args.max_len} reserve={args.reserve:g} copies={st['copies']} "
          f"bytes_moved={st['bytes_moved']} staging_bytes={st['staging_bytes']} "
          f"kv_buffer_bytes={manager.nbytes} requantizations={st['requantizations']}")
    return 0


def _prompt_ids(tok, prompt: str, raw: bool) -> list[int]:
    if not prompt:
        raise ValueError("--prompt must not be empty")
    if not raw and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        return list(tok(text, add_special_tokens=False)["input_ids"])
    return list(tok(prompt)["input_ids"])


def _graphs(model, tok, args: argparse.Namespace):
    """The export folder for these settings: reused when its metadata matches, exported (once) otherwise.  An
    explicit ``--onnx-dir`` holding graphs for another model or other settings is an error, not overwritten."""
    from kvsqueeze.engines.onnx_export import (
        default_onnx_dir,
        export_static_graphs,
        model_fingerprint,
        read_meta_json,
    )

    fp = model_fingerprint(model)
    want = {"fingerprint": fp, "max_len": str(args.max_len), "kv": args.kv, "layout": args.layout,
            "batch_size": "1"}
    quant_args = None
    if args.kv != "float":
        from kvsqueeze.engines.static_calibration import calib_digest, calibration_text

        text, source = calibration_text(args.calib_text)
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
        quant_args = dict(bits=int(args.kv[3]), symmetric=args.symmetric, granularity=args.granularity,
                          method=args.calib_method)
        want["calib"] = calib_digest(repr(ids[:4096]), **quant_args)
    folder = default_onnx_dir(fp, args.max_len, args.kv, layout=args.layout) if args.onnx_dir is None \
        else _explicit_dir(args.onnx_dir)
    meta = read_meta_json(folder)
    if meta is not None:
        got = {k: meta.get(f"kvsqueeze.{k}") for k in want}
        if got == want:
            return folder
        if args.onnx_dir is not None:
            if got["fingerprint"] != fp:
                raise ValueError(f"the ONNX graphs in {folder} were exported from another model "
                                 f"(fingerprint {got['fingerprint']}, this model is {fp})")
            diff = ", ".join(f"{k}: {got[k]} (requested {want[k]})" for k in want if got[k] != want[k])
            raise ValueError(f"the ONNX graphs in {folder} were exported with other settings ({diff}); "
                             f"use another --onnx-dir or remove that folder")
    quant = None
    if quant_args is not None:
        from kvsqueeze.engines.static_calibration import calibrate_static

        print(f"kvsqueeze: calibrating {args.kv} K/V parameters on {source}", file=sys.stderr)
        quant = calibrate_static(model, ids, **quant_args)
    print(f"kvsqueeze: exporting static ONNX graphs (S={args.max_len}, {args.kv}) to {folder} once",
          file=sys.stderr)
    extra = {"calib": want["calib"]} if "calib" in want else None
    return export_static_graphs(model, folder, args.max_len, quant=quant, layout=args.layout, extra_meta=extra)


def _explicit_dir(path: str):
    from pathlib import Path

    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--onnx-dir {folder} is a file, not a folder")
    if folder.is_dir() and any(folder.iterdir()) and not (folder / "decode.onnx").is_file():
        raise ValueError(f"--onnx-dir {folder} is not empty and holds no exported graphs (decode.onnx)")
    return folder
