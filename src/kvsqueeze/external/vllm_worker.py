"""The vLLM side of the vLLM peer: a script run in its own process by the interpreter that has vLLM.

vLLM pins its own torch and transformers, so this file imports nothing from kvsqueeze (and nothing but the
standard library before vLLM): ``kvsqueeze.external.vllm_client`` runs it by path as ``PYTHON vllm_worker.py
REQUEST.json RESULT.json``.  The request names one task on one engine:

* ``info``: vLLM's version and the KV cache dtypes it accepts (no model is loaded);
* ``check``: whether vLLM and its attention backend on this machine run each of ``kv_cache_dtypes`` (no model is
  loaded: the checks :func:`_engine` makes before starting one); ``kvsqueeze-<format>`` names kvsqueeze's plugin
  (its packed pages in vLLM's pool), which must be installed beside vLLM;
* ``logprobs``: every prompt token's log-probability (``prompt_logprobs``) for prompts given as token ids;
* ``speed``: prefill seconds and decode milliseconds per token of random prompts given as token ids, for each of
  ``prompt_sets`` (one batch each, e.g. one per context length) on one engine;
* ``measure``: ``logprobs`` and ``speed`` on one engine (vLLM takes seconds to start).

The result is ``{"ok": true, ...}`` or ``{"ok": false, "error": "<one line>"}``; vLLM's own log goes to stderr.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
import typing

_REQUEST_IDS = itertools.count()


def _accepted_kv_dtypes() -> list[str]:
    from vllm.config.cache import CacheDType

    return list(typing.get_args(CacheDType))


def _check_cpu_backend(kv_cache_dtype: str) -> None:
    """vLLM's config accepts dtypes that its CPU attention backend does not implement (some then run through
    other paths and give broken perplexity): refuse those on a CPU."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    supported = list(CPUAttentionBackend.supported_kv_cache_dtypes)
    if kv_cache_dtype not in supported:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not implemented by vLLM's CPU attention backend; "
                         f"allowed on a CPU: {', '.join(supported)}")
    # the ISA check vLLM makes in its engine process (whose failure reaches us only as "initialization failed")
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        _get_attn_isa(torch.bfloat16, 32, None, kv_cache_dtype)
    except NotImplementedError as exc:
        raise ValueError(f"vLLM cannot run kv_cache_dtype {kv_cache_dtype!r} on this CPU: {exc}") from None


# kv_cache_dtype "kvsqueeze-<format>": vLLM's own "auto" dtype with kvsqueeze's plugin (entry point
# vllm.general_plugins "kvsqueeze") storing <format> in vLLM's pages; the plugin reads the format from this variable
KVSQUEEZE_PREFIX = "kvsqueeze-"
PLUGIN_ENV = "KVSQUEEZE_VLLM_KV"
PLUGIN_FORMATS = ("kivi-4", "kivi-2", "int8", "kivi-4-sink4", "kivi-2-sink4")  # kvsqueeze.kernels.paged.FORMATS (a test keeps them equal)
PLUGIN_BLOCK_SIZE = 32  # kvsqueeze.kernels.paged.PAGE_TOKENS
PLUGIN_INSTALL = ("install kvsqueeze into vLLM's virtualenv without its dependencies (it brings the plugin): "
                  "VLLM_PYTHON -m pip install --no-deps KVSQUEEZE_SOURCE (docs/vllm.md)")


def _check_plugin(kv_cache_dtype: str) -> str:
    """The format of a ``kvsqueeze-<format>`` dtype, once the plugin is known to be installed beside vLLM."""
    from importlib.metadata import entry_points

    fmt = kv_cache_dtype[len(KVSQUEEZE_PREFIX):]
    if fmt not in PLUGIN_FORMATS:
        raise ValueError(f"kvsqueeze's vLLM plugin has no format {fmt!r}; allowed: "
                         f"{', '.join(KVSQUEEZE_PREFIX + f for f in PLUGIN_FORMATS)}")
    if not any(ep.name == "kvsqueeze" for ep in entry_points(group="vllm.general_plugins")):
        raise ValueError(f"{kv_cache_dtype} needs kvsqueeze's vLLM plugin, which this vLLM environment lacks: "
                         f"{PLUGIN_INSTALL}")
    return fmt


def _check_kv_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype.startswith(KVSQUEEZE_PREFIX):
        _check_plugin(kv_cache_dtype)
        return
    if kv_cache_dtype not in _accepted_kv_dtypes():
        raise ValueError(f"vLLM does not accept kv_cache_dtype {kv_cache_dtype!r}; allowed: "
                         f"{', '.join(_accepted_kv_dtypes())}")
    _check_cpu_backend(kv_cache_dtype)


def _engine(req: dict):
    from vllm import LLM

    kv_cache_dtype = req["kv_cache_dtype"]
    _check_kv_dtype(kv_cache_dtype)
    extra = {}
    if kv_cache_dtype.startswith(KVSQUEEZE_PREFIX):
        # set before the engine starts: its processes inherit it and the plugin reads it there
        os.environ[PLUGIN_ENV] = _check_plugin(kv_cache_dtype)
        kv_cache_dtype, extra = "auto", {"block_size": PLUGIN_BLOCK_SIZE}
    else:
        os.environ.pop(PLUGIN_ENV, None)  # the plugin stays inert
    kwargs = {"model": req["model"], "tokenizer": req["model"], "dtype": req.get("dtype", "bfloat16"),
              "kv_cache_dtype": kv_cache_dtype, "max_model_len": int(req["max_model_len"]),
              "seed": 0, "enforce_eager": True, "enable_prefix_caching": False,
              "max_num_seqs": int(req.get("max_num_seqs", 8)), **extra}
    if req.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = int(req["max_num_batched_tokens"])
    return LLM(**kwargs)


def _prompts(rows: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": [int(t) for t in row]} for row in rows]


def _logprobs(llm, rows: list[list[int]]) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    start = time.perf_counter()
    outs = llm.generate(_prompts(rows), params, use_tqdm=False)
    seconds = time.perf_counter() - start
    nll = []
    for row, out in zip(rows, outs):
        lps = out.prompt_logprobs
        # position j holds the log-probability of token j given tokens < j (None at position 0)
        nll.append([-float(lps[j][int(row[j])].logprob) for j in range(1, len(row))])
    return {"nll": nll, "seconds": seconds}


def _timed_generate(llm, rows: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """Greedy ``max_tokens`` for every row, as one batch, stepping vLLM's engine: (seconds from submission until
    every row has its first token, seconds from then until the last token)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    for row in rows:
        engine.add_request(f"kvsqueeze-speed-{next(_REQUEST_IDS)}", {"prompt_token_ids": [int(t) for t in row]},
                           params)
    produced: dict[str, int] = {}
    first = last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
        last = time.perf_counter()
        if first is None and len(produced) == len(rows) and min(produced.values()) >= 1:
            first = last
    if first is None or min(produced.values()) != max_tokens:
        raise RuntimeError(f"vLLM produced {sorted(produced.values())} tokens per row, not {max_tokens}")
    return first - start, last - first


def _speed(llm, prompt_sets: list[list[list[int]]], decode: int) -> dict:
    """Per set: prefill = time to the first token of every row; decode ms/token = time from there to the last
    token over the ``decode`` steps in between (vLLM's time per output token), one run on one engine."""
    _timed_generate(llm, [row[:8] for row in prompt_sets[0]], 2)  # warm-up
    runs = []
    for rows in prompt_sets:
        prefill, decoding = _timed_generate(llm, rows, decode + 1)
        runs.append({"prefill_s": prefill, "decode_s": decoding, "decode_ms_per_token": 1000 * decoding / decode})
    return {"runs": runs}


def _pool(llm) -> dict:
    """vLLM's KV pool as its engine sized it (the count it logs as its KV cache size): blocks, tokens per block,
    tokens in all, and the KV space it was given ($VLLM_CPU_KVCACHE_SPACE on a CPU)."""
    cache = llm.llm_engine.vllm_config.cache_config
    blocks, size = int(cache.num_gpu_blocks or 0), int(cache.block_size)
    return {"kv_blocks": blocks, "block_size": size, "kv_tokens": blocks * size,
            "kv_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE")}


def task_check(req: dict) -> dict:
    for kv_cache_dtype in req["kv_cache_dtypes"]:
        _check_kv_dtype(kv_cache_dtype)
    return {}


def task_logprobs(req: dict) -> dict:
    llm = _engine(req)
    return {**_logprobs(llm, req["prompts"]), "pool": _pool(llm)}


def task_speed(req: dict) -> dict:
    llm = _engine(req)
    return {**_speed(llm, req["prompt_sets"], int(req["decode_tokens"])), "pool": _pool(llm)}


def task_measure(req: dict) -> dict:
    """``logprobs`` of ``prompts`` and ``speed`` of ``prompt_sets`` on one engine (it starts once)."""
    llm = _engine(req)
    nll = _logprobs(llm, req["prompts"]) if req["prompts"] else {}  # no prompts: no corpus, speed only
    return {**nll, **_speed(llm, req["prompt_sets"], int(req["decode_tokens"])), "pool": _pool(llm)}


TASKS = {"check": task_check, "logprobs": task_logprobs, "speed": task_speed, "measure": task_measure}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: vllm_worker.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    req = json.loads(open(argv[1], encoding="utf-8").read())
    try:
        import vllm

        result = {"ok": True, "vllm_version": vllm.__version__}
        if req["task"] == "info":
            result["kv_cache_dtypes"] = _accepted_kv_dtypes()
        else:
            result |= TASKS[req["task"]](req)
    except Exception as exc:  # reported to the client as one line; vLLM's traceback stays on stderr
        import traceback

        traceback.print_exc()
        msg = " ".join(f"{type(exc).__name__}: {exc}".split())
        result = {"ok": False, "error": msg[:600]}
    tmp = argv[2] + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(tmp, argv[2])
    return 0


if __name__ == "__main__":  # vLLM starts its engine core in a child process: guard the entry point
    sys.exit(main(sys.argv))
