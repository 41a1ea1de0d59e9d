"""What the scripts in ``benchmarks/`` share: common options, model loading with the thread count set first,
machine metadata (CPU, instruction-set flags, load), interleaved median timing and atomic JSON output.

Scripts import it as ``from kvsqueeze.eval.benchkit import ...`` with kvsqueeze installed (``pip install -e .``)
or ``PYTHONPATH=src``; none of them edits ``sys.path``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from .meta import cpu_load, machine_info, now, write_json_atomic

T = TypeVar("T")
ISA_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi", "avx512_bf16", "amx_tile")


def add_common_args(parser: argparse.ArgumentParser, threads: int | None = 1, model: bool = True) -> None:
    """``--model``, ``--threads`` and ``--json`` with the same meaning in every script."""
    if model:
        parser.add_argument("--model", default=None,
                            help="Hugging Face directory, .gguf file or hub id (default: the embedded SmolLM2-135M)")
    parser.add_argument("--threads", type=int, default=threads,
                        help=f"torch intra-op threads (default: {threads or 'the library default'})")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON to FILE")


def set_threads(threads: int | None) -> int:
    from ..models import set_threads as _set

    return _set(threads)


def load(args: argparse.Namespace, dtype: Any = None) -> tuple[Any, Any, int]:
    """Set the thread count first (it affects every timing), then load ``args.model``: (model, tokenizer, threads)."""
    import torch

    from ..models import load_model

    threads = set_threads(args.threads)
    model, tokenizer = load_model(getattr(args, "model", None), dtype=dtype or torch.float32, progress=False)
    return model, tokenizer, threads


def cpu_flags() -> list[str]:
    """The instruction-set flags of :data:`ISA_FLAGS` this CPU reports (Linux ``/proc/cpuinfo``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in ISA_FLAGS if f in have]
    except OSError:
        pass
    return []


def machine_block(threads: int | None = None) -> dict[str, Any]:
    """Machine metadata for a result file: CPU, flags, memory, versions, threads, load and time of the run."""
    info = machine_info()
    return info | {"isa_flags": cpu_flags(), "threads": threads, "load": cpu_load(), "date": now()}


def machine_line(threads: int | None = None) -> str:
    """One line naming the machine, for the top of a printed table."""
    info = machine_info()
    flags = ", ".join(cpu_flags()) or "no AVX2/AVX-512 flags"
    return f"{info['cpu']} ({flags}); {threads or info['torch_threads']} thread(s); torch {info['versions']['torch']}"


def shuffled_rounds(items: Sequence[T], repeats: int, seed: int = 0) -> Iterator[list[T]]:
    """``repeats`` rounds of all ``items``, each in a new seeded order: timed in a fixed order, an item always runs
    after the same neighbour and meets the caches it left (attention_micro.py measured 10-25% on one method so)."""
    order, shuffler = list(items), random.Random(seed)
    for _ in range(repeats):
        shuffler.shuffle(order)
        yield list(order)


def interleaved_medians(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1,
                        clock: Callable[[], float] = time.perf_counter, seed: int = 0) -> dict[str, float]:
    """Median seconds per call of every function, timed in rounds (call i of each before call i+1 of any), so
    background load on a shared machine hits all of them alike; each round in a new order (:func:`shuffled_rounds`)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for order in shuffled_rounds(list(fns.items()), repeats, seed):
        for name, fn in order:
            t = clock()
            fn()
            times[name].append(clock() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def write_json(path: str | Path, doc: Any) -> Path:
    """Write ``doc`` atomically (a reader never sees a partial file); NaN/inf become null."""
    return write_json_atomic(path, doc)
