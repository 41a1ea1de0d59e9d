"""Options shared by the sub-commands, each defined once with one default: --model, --kv, --threads, --json.

Nothing heavy is imported here at module level: building a command's parser must stay cheap.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

DEFAULT_THREADS = 2
JSON_STDOUT = "-"
_json_stream: TextIO | None = None  # the real standard output while json_output() redirects the rest

MODEL_HELP = ("model: a Hugging Face directory, a .gguf file or a hub id (default: the embedded "
              "SmolLM2-135M-Instruct)")
KV_HELP = ("cache: a preset (kvsqueeze presets), a spec string like k2c32-v2t32-w128-s4, JSON, a calibration "
           "artifact directory (or a folder holding exactly one, as kvsqueeze calibrate --out writes), or a peer "
           "such as hf-dynamic, hf-quanto-int4, vllm:fp8_e4m3 (vLLM's own cache, README: vLLM), llamacpp:q4_0 "
           "(llama.cpp's own cache, README: llama.cpp)")


def _int_at_least(text: str, low: int, expected: str, bound: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    return _int_at_least(text, 1, "a positive integer", "at least 1")


def json_destination(text: str) -> str:
    """argparse type: ``-`` (standard output) or a file path that is not a directory."""
    if text != JSON_STDOUT and Path(text).expanduser().is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name, or - for standard output")
    return text


def csv(kind):
    """An argparse type: a comma-separated list of ``kind`` (empty items dropped)."""
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
    return parse


def add_model(p: argparse.ArgumentParser, help: str = MODEL_HELP) -> None:
    p.add_argument("--model", default=None, help=help)


def add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=positive_int, default=DEFAULT_THREADS,
                   help=f"torch CPU threads, fixed for the whole run (default {DEFAULT_THREADS})")


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def add_device(p: argparse.ArgumentParser) -> None:
    """--device, --dtype and --random-weights/--layers: where and in what a timed model runs."""
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="run the model and its cache here (default cpu; cuda needs a CUDA GPU)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="model dtype (default fp32 on cpu, bf16 on cuda)")
    p.add_argument("--random-weights", default=None, metavar="SHAPE",
                   help="time an architecture with random weights instead of --model: llama-3.1-8b, qwen2.5-7b, "
                        "mistral-7b, smollm2-135m, or a config.json path (reports say 'random weights')")
    p.add_argument("--layers", type=positive_int, default=None,
                   help="with --random-weights: keep only the first N decoder layers")


def model_for_device(args: argparse.Namespace) -> tuple[Any, int]:
    """(model, threads) per --model / --random-weights, --device and --dtype; a bad combination is refused in one
    line before anything loads."""
    import torch

    from kvsqueeze.eval import meta

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible to torch here (torch "
                         f"{torch.__version__}); allowed here: --device cpu")
    if args.random_weights is not None and args.model is not None:
        raise ValueError("--random-weights and --model exclude each other: pick one")
    if args.layers is not None and args.random_weights is None:
        raise ValueError("--layers needs --random-weights")
    dtype = getattr(torch, DTYPES[args.dtype or ("bf16" if args.device == "cuda" else "fp32")])
    if args.random_weights is None:
        model, _, threads = meta.load_for_eval(args.model, args.threads)
        return model.to(args.device, dtype), threads
    from kvsqueeze.models import set_threads
    from kvsqueeze.random_models import config_fields, random_model

    config_fields(args.random_weights)  # an unknown name fails before the threads are set
    threads = set_threads(args.threads)
    return random_model(args.random_weights, args.layers, dtype, args.device), threads


def add_model_and_threads(p: argparse.ArgumentParser) -> None:
    add_model(p)
    add_threads(p)


def add_corpus(group: Any, what: str = "corpus") -> None:
    """--text FILE and --dataset NAME, into a mutually exclusive ``group``; with neither, the resolution of
    :mod:`kvsqueeze.corpus` (WikiText-2 found or fetched, else the corpus Python ships)."""
    from kvsqueeze.corpus import DATASETS

    group.add_argument("--text", default=None, metavar="FILE", help=f"{what}: a UTF-8 text file")
    group.add_argument("--dataset", default=None, choices=DATASETS,
                       help=f"{what} by name, with no fallback. Without --text or --dataset: WikiText-2 from "
                            "$KVSQUEEZE_DATA, the local cache or the hub (fetched once, SHA-256 verified, cached), "
                            "else (offline) python-docs, the Python interpreter's own documentation text")


def non_negative_int(text: str) -> int:
    """argparse type: an integer of at least 0 (for --prefill-chunk, 0 = one pass)."""
    return _int_at_least(text, 0, "a whole number of tokens", "0 (one pass) or a positive number of tokens")


def add_prefill_chunk(p: argparse.ArgumentParser) -> None:
    from kvsqueeze.spec import DEFAULT_PREFILL_CHUNK

    p.add_argument("--prefill-chunk", type=non_negative_int, default=DEFAULT_PREFILL_CHUNK, metavar="N",
                   help=f"prompt tokens per forward pass (per sequence) when filling the cache; 0 = the whole prompt "
                        f"in one pass. Chunks bound the memory of a long prompt: each chunk's K/V are quantized as "
                        f"soon as they leave the window (default {DEFAULT_PREFILL_CHUNK})")


def check_prefill_chunk(args: argparse.Namespace, model: Any) -> int:
    """--prefill-chunk against the model's context (after the model is loaded)."""
    from kvsqueeze.spec import check_prefill_chunk as check

    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    return check(args.prefill_chunk, limit)


def add_kv(p: argparse.ArgumentParser, default: str | None = None, help: str = KV_HELP) -> None:
    """--kv: required unless the command has a ``default``."""
    if default is None:
        p.add_argument("--kv", required=True, help=help)
    else:
        p.add_argument("--kv", default=default, help=f"{help} (default {default})")


def add_json(p: argparse.ArgumentParser, what: str = "the result") -> None:
    p.add_argument("--json", default=None, type=json_destination, metavar="PATH",
                   help=f"write {what} as JSON to PATH (atomically, at the end); - writes it to standard output "
                        f"and the human-readable lines to standard error")


def resolve_kv_option(value: Any) -> Any:
    """The CacheSpec or peer that a --kv value names.  The evaluation peers are registered first, so their
    names resolve (and the message for an unknown name lists them)."""
    import kvsqueeze.eval.peers  # noqa: F401  (registers transformers' caches as peers)
    from kvsqueeze.resolve import resolve_kv

    return resolve_kv(value)


def cache_spec_option(value: Any, command: str) -> Any:
    """Like :func:`resolve_kv_option` for commands that build kvsqueeze's own cache: a peer is refused."""
    import kvsqueeze.eval.peers  # noqa: F401  (so that a peer's name is recognised and refused clearly)
    from kvsqueeze.resolve import resolve_cache_spec

    return resolve_cache_spec(value, f"kvsqueeze {command}")


def json_to_stdout(args: argparse.Namespace) -> bool:
    return getattr(args, "json", None) == JSON_STDOUT


@contextlib.contextmanager
def json_output(args: argparse.Namespace) -> Iterator[None]:
    """With ``--json -``, send everything printed inside the block to standard error, keeping the real standard
    output for the one JSON document :func:`write_json` writes; otherwise do nothing."""
    global _json_stream
    if not json_to_stdout(args):
        yield
        return
    saved, _json_stream = _json_stream, sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _json_stream = saved


def write_json(args: argparse.Namespace, record: dict[str, Any]) -> None:
    """Write ``record`` where --json says: a file (atomically; a line saying so is printed) or standard output
    (the real one, inside :func:`json_output`)."""
    from kvsqueeze.eval import meta

    if json_to_stdout(args):
        stream = _json_stream or sys.stdout
        # the same document write_json_atomic writes: NaN and infinities as null, indent 2
        json.dump(meta._finite(record), stream, indent=2, allow_nan=False, default=str)
        stream.write("\n")
        stream.flush()
    else:
        print(f"wrote {meta.write_json_atomic(args.json, record)}")
