"""The main job: perplexity, retrieval, speed and memory of kvsqueeze presets, transformers' caches and (named with
``--kv vllm:<dtype>`` / ``llamacpp:<type>``) vLLM's and llama.cpp's, measured in one run on one model, written as
report.md + results.json + PNG plots under bench/<timestamp>/."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..errors import UnsupportedCacheError
from ..external.vllm_client import VllmError
from ..layout import model_kv_layout
from ..resolve import resolve_kv
from ..spec import DEFAULT_PREFILL_CHUNK, check_prefill_chunk
from . import engine_peers, meta, report
from .capacity import DEFAULT_BUDGET
from .engine_peers import is_engine
from .peers import PEERS, Peer, describe
from .retrieval import generated_haystack
from .vllm_peer import is_vllm

# seconds to start a vLLM engine on the embedded model (import, load, profile), measured ~12 s on 2 idle cores
VLLM_ENGINE_START_S = 15.0
QUICK_PRESETS = ("full", "int8", "int4", "kivi-4", "kivi-2", "kivi-2-sink4")
QUICK_PEERS = ("hf-dynamic", "hf-quanto-int4", "hf-quanto-int2")
FULL_PRESETS = ("full", "int8", "fp8-e4m3", "int4", "int2", "kivi-4", "kivi-3", "kivi-2", "kivi-4-sink4",
                "kivi-3-sink4", "kivi-2-sink4", "rot-3.5", "rot-3")
FULL_PEERS = tuple(PEERS)


@dataclass
class BenchPlan:
    quick: bool
    caches: list[str]
    ppl_context: int
    ppl_chunks: int
    ppl_decode_tokens: int  # tokens scored one step at a time at the end of each chunk (decode column)
    lengths: list[int]
    depths: list[float]
    trials: int
    speed_contexts: list[int]
    speed_decode_tokens: int
    retrieval_format: str = "plain"
    exact_decode: bool = False  # decode column of kvsqueeze presets by real decoding instead of the window
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens per forward pass (decode column, retrieval, speed)
    budget_bytes: int = DEFAULT_BUDGET  # the memory budget of the capacity figures
    skipped: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("skipped")
        return d


def make_plan(quick: bool, caches: list[str] | None = None, **overrides: Any) -> BenchPlan:
    """Default sizes for --quick (< 10 min on 2 cores with the embedded model) or the full run, then overrides.

    Caches named explicitly must all be usable: a vLLM peer needs vLLM, and vLLM on this machine must run its KV
    dtype (checked here, in one child process, before any model is loaded: fp8 on a CPU without AVX-512 is refused
    in one line).  From the default list (which names no vLLM peer), peers whose optional library is missing are
    skipped with a note."""
    if quick:
        plan = BenchPlan(True, [*QUICK_PRESETS, *QUICK_PEERS], ppl_context=512, ppl_chunks=2, ppl_decode_tokens=128,
                         lengths=[1024], depths=[0.0, 0.5, 1.0], trials=1, speed_contexts=[512, 2048],
                         speed_decode_tokens=8)
    else:
        # about an hour on 2 idle cores with the embedded model (17 caches); --ppl-chunks, --lengths, --depths
        # make it larger (8k retrieval alone would add ~20 minutes)
        plan = BenchPlan(False, [*FULL_PRESETS, *FULL_PEERS], ppl_context=2048, ppl_chunks=4, ppl_decode_tokens=128,
                         lengths=[1024, 2048, 4096], depths=[0.0, 0.5, 1.0], trials=1,
                         speed_contexts=[1024, 8192], speed_decode_tokens=16)
    for key, value in overrides.items():
        if value is not None:
            setattr(plan, key, value)
    if caches is not None:
        plan.caches = list(dict.fromkeys(caches))
        for name in plan.caches:  # an unknown name or a missing library: one line
            resolve_kv(name)
    else:
        usable = []
        for name in plan.caches:
            try:
                resolve_kv(name)
                usable.append(name)
            except ValueError as exc:
                plan.skipped.append(f"{name}: {exc}")
        plan.caches = usable
    _validate(plan)
    engine_peers.check_runs_here([kv for kv in map(resolve_kv, plan.caches) if is_engine(kv)])  # after cheap checks
    return plan


def _validate(plan: BenchPlan) -> None:
    if not plan.caches:
        raise ValueError("no cache to measure")
    if len(plan.speed_contexts) < 1 or min(plan.speed_contexts) < 1:
        raise ValueError("speed contexts must be positive token counts")
    for what, v in (("--ppl-context", plan.ppl_context), ("--ppl-chunks", plan.ppl_chunks),
                    ("--trials", plan.trials), ("--decode-tokens", plan.speed_decode_tokens)):
        if v < 1:
            raise ValueError(f"{what} must be positive, got {v}")
    if not 1 <= plan.ppl_decode_tokens <= plan.ppl_context - 2:
        raise ValueError(f"--ppl-decode-tokens must be in [1, {plan.ppl_context - 2}], got {plan.ppl_decode_tokens}")


# ------------------------------------------------------------------------------------------------ estimate
def estimate_seconds(plan: BenchPlan, model: Any, with_ppl: bool) -> float:
    """Expected wall time from a short calibration on this machine (a 256-token prefill, a few decode steps).

    Prefill cost grows ~linearly plus an attention term, decode steps grow with the context; emulated
    protocols and quantized caches carry rough overhead factors.  An estimate, printed as such."""
    import statistics

    import torch

    from ..adapter import cache_kwargs
    from .peers import make_cache, prefill

    ids = torch.randint(0, model.get_output_embeddings().weight.shape[0], (1, 264))
    with torch.no_grad():
        model.base_model(input_ids=ids[:, :8], use_cache=False)
        t = time.perf_counter()
        cache = make_cache(model, "hf-dynamic")
        prefill(model, ids[:, :256], cache)
        per_token = (time.perf_counter() - t) / 256
        steps = []
        for i in range(4):
            t = time.perf_counter()
            model.base_model(input_ids=ids[:, 256 + i:257 + i], **cache_kwargs(model.base_model, cache),
                             use_cache=True)
            steps.append(time.perf_counter() - t)
    step = statistics.median(steps)

    def pre(n: int) -> float:
        return per_token * n * (1 + n / 4096) / (1 + 256 / 4096)

    def dec(n: int) -> float:
        return step * (1 + n / 3300) / (1 + 256 / 3300)

    def factor(name: str) -> float:
        kv = resolve_kv(name)
        return 1.0 if (isinstance(kv, Peer) and kv.backend == "dynamic") else 2.0

    total = 0.0
    for name in plan.caches:
        if is_engine(resolve_kv(name)):  # one engine start, then about a plain forward's cost
            start_s = VLLM_ENGINE_START_S if is_vllm(resolve_kv(name)) else 1.0  # llama.cpp: a GGUF load
            total += start_s + sum(pre(n) + plan.speed_decode_tokens * dec(n) for n in plan.speed_contexts)
            total += plan.ppl_chunks * pre(plan.ppl_context) if with_ppl else 0.0
            continue
        f = factor(name)
        peer = isinstance(resolve_kv(name), Peer)
        if with_ppl:
            n, c = plan.ppl_context, plan.ppl_chunks
            decode = c * (pre(n - plan.ppl_decode_tokens) + f * plan.ppl_decode_tokens * dec(n))
            if peer:
                total += decode
            else:  # emulated passes cost about two plain ones; two footprint prefills
                total += c * 2 * 2.0 * pre(n) + 2 * pre(n) + (decode if plan.exact_decode else c * 2.0 * pre(n))
        for length in plan.lengths:
            total += len(plan.depths) * plan.trials * (pre(length) + 8 * f * dec(length))
        for n in plan.speed_contexts:
            total += pre(n) + plan.speed_decode_tokens * f * dec(n)
    return total


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f}" if seconds >= 600 else f"{seconds / 60:.1f}"


def expected_time(measured: float, load: dict[str, Any], threads: int) -> dict[str, Any]:
    """The estimate in words: measured on the machine as it is; when other programs are running (their load
    average, spread over the CPUs this process may use, leaves fewer than ``threads`` free), also what an idle
    machine would take, assuming the time scales with the share of the CPUs this run gets."""
    cpus, other = load["cpus_available"], load["other_load"]
    minutes = f"about {_minutes(measured)} min"
    if other is None:
        return {"seconds": measured, "idle_seconds": None, "busy": None,
                "text": f"{minutes} on this machine ({threads} threads; from a short calibration run; the load of "
                        f"other programs is unknown here)"}
    slowdown = max(1.0, (other + threads) / cpus)
    busy = slowdown > 1.0 and other >= 0.5
    if not busy:
        return {"seconds": measured, "idle_seconds": measured, "busy": False,
                "text": f"{minutes} on this machine ({threads} threads; from a short calibration run; load "
                        f"average {other:.1f} on {cpus} CPUs: nothing else competes)"}
    idle = measured / slowdown
    return {"seconds": measured, "idle_seconds": idle, "busy": True,
            "text": f"{_minutes(idle)} to {_minutes(measured)} min: {minutes} on this machine as it is now (load "
                    f"average {other:.1f} on {cpus} CPUs before this run: other programs compete for the CPUs, "
                    f"and timings in the report are slower than on an idle machine), about {_minutes(idle)} min "
                    f"if it were idle ({threads} threads; from a short calibration run)"}


# ------------------------------------------------------------------------------------------------ stages
def _bar(total: int, desc: str, enabled: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, disable=not enabled, dynamic_ncols=True)


def _in_process(plan: BenchPlan) -> list[str]:
    """The caches measured through transformers (all but the engine peers': :func:`run_engine_stage`)."""
    return [c for c in plan.caches if not is_engine(resolve_kv(c))]


def run_ppl_stage(model: Any, chunks: Any, plan: BenchPlan, progress: bool) -> dict[str, dict[str, Any]]:
    from .ppl import run_ppl

    out: dict[str, dict[str, Any]] = {"window": {}, "all-quantized": {}, "decode": {}}
    footprints: dict[str, dict[str, Any]] = {}
    prefix = plan.ppl_context - plan.ppl_decode_tokens
    n = plan.ppl_chunks
    caches = _in_process(plan)
    peers = [c for c in caches if isinstance(resolve_kv(c), Peer)]
    ours = [c for c in caches if c not in peers]
    with _bar(n * (3 * len(ours) + len(peers)), "perplexity", progress) as bar:
        for name in ours:
            bar.set_postfix_str(name)
            out["window"][name] = run_ppl(model, chunks, name, "window", 0, bar, footprints)
            out["all-quantized"][name] = run_ppl(model, chunks, name, "all-quantized", 0, bar, footprints)
            if plan.exact_decode:
                out["decode"][name] = run_ppl(model, chunks, name, "decode", prefix, bar,
                                              prefill_chunk=plan.prefill_chunk)
            else:
                r = run_ppl(model, chunks, name, "window", prefix, bar, footprints, plan.prefill_chunk)
                r["emulated_by"] = f"window protocol with prefix {prefix} (equal to decode through the real cache)"
                out["decode"][name] = r
        for name in peers:
            bar.set_postfix_str(name)
            out["decode"][name] = run_ppl(model, chunks, name, "decode", prefix, bar, prefill_chunk=plan.prefill_chunk)
    return out


def run_retrieval_stage(model: Any, tokenizer: Any, plan: BenchPlan, progress: bool) -> dict[str, dict[str, Any]]:
    from .retrieval import run_retrieval

    out = {}
    per = len(plan.lengths) * len(plan.depths) * plan.trials
    caches = _in_process(plan)  # vLLM: not run (the report says so)
    with _bar(per * len(caches), "retrieval", progress) as bar:
        for name in caches:
            bar.set_postfix_str(name)
            out[name] = run_retrieval(model, tokenizer, name, plan.lengths, plan.depths, plan.trials,
                                      plan.retrieval_format, progress=bar, prefill_chunk=plan.prefill_chunk)
    return out


def run_speed_stage(model: Any, plan: BenchPlan, progress: bool) -> dict[str, dict[str, Any]]:
    from .speed import measure_speed

    out: dict[str, dict[str, Any]] = {}
    caches = _in_process(plan)
    with _bar(len(caches) * len(plan.speed_contexts), "speed", progress) as bar:
        for name in caches:
            bar.set_postfix_str(name)
            out[name] = {}
            # untimed warm-up of this cache kind: the first call pays one-off costs (loading the C++ kernel,
            # the allocator growing to prefill sizes) that would otherwise land on whichever cache runs first
            measure_speed(model, name, min(256, min(plan.speed_contexts)), 2, prefill_chunk=plan.prefill_chunk)
            for ctx in sorted(plan.speed_contexts):
                out[name][str(ctx)] = measure_speed(model, name, ctx, plan.speed_decode_tokens,
                                                    prefill_chunk=plan.prefill_chunk)
                bar.update(1)
    return out


def run_capacity_stage(model: Any, plan: BenchPlan, speed: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Capacity in the budget per in-process cache: its exact bytes (two random fills) and the peak beyond them
    in its longest speed run (:mod:`kvsqueeze.eval.capacity`)."""
    from . import capacity as cap

    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    out = {}
    for name, runs in speed.items():
        longest = runs[str(max(plan.speed_contexts))]
        if longest.get("peak_rss_delta_bytes") is None:
            continue
        out[name] = cap.capacity(cap.cache_cost(model, name), cap.transient_per_sequence(longest),
                                 plan.budget_bytes, limit)
        out[name]["transient_measured_at"] = longest["context"]
    return out


def run_engine_stage(model: Any, chunks: Any, plan: BenchPlan, progress: bool, model_source: str | None,
                     threads: int, results: dict[str, Any]) -> dict[str, str]:
    """The engine peers' rows (vLLM, one engine per KV dtype in a child process; llama.cpp through its bindings):
    perplexity (all-quantized protocol) on the same ``chunks`` and speed on the same prompts, added to
    ``results["ppl"]["all-quantized"]`` and ``results["speed"]``.  An engine's failure (say a model it cannot
    load) does not end the bench: returns {name: the one-line reason}."""
    failed: dict[str, str] = {}
    names = [c for c in plan.caches if is_engine(resolve_kv(c))]
    vocab = model.get_output_embeddings().weight.shape[0]
    contexts = sorted(plan.speed_contexts)
    with _bar(len(names), "engines", progress) as bar:
        for name in names:
            bar.set_postfix_str(name)
            try:
                ppl, speed = engine_peers.measure(resolve_kv(name), chunks, model_source, vocab, contexts,
                                                  plan.speed_decode_tokens, threads, model_kv_layout(model.config))
            except (VllmError, UnsupportedCacheError) as exc:
                failed[name] = str(exc)
            else:
                if ppl is not None:
                    results["ppl"]["all-quantized"][name] = ppl
                results["speed"][name] = {str(ctx): r for ctx, r in speed.items()}
            bar.update(1)
    return failed


def not_measured(plan: BenchPlan, failed: dict[str, str]) -> dict[str, dict[str, str]]:
    """Per cache, the report cells it cannot fill and why (short): an engine peer's protocols and memory, its
    engine's failure."""
    out: dict[str, dict[str, str]] = {}
    for name in plan.caches:
        kv = resolve_kv(name)
        if is_engine(kv):
            out[name] = engine_peers.not_applicable(kv)
            if name in failed:
                out[name] |= {"all-quantized": "its engine failed", "speed": "its engine failed"}
    return out


# ------------------------------------------------------------------------------------------------ main
def run_bench(args: Any, plan: BenchPlan, out_root: Path, progress: bool = True) -> Path:
    """Run every stage and write the report folder; returns its path (complete, or absent on failure)."""
    from .. import corpus as corpus_mod

    start = time.perf_counter()
    load = meta.cpu_load()  # read first: the load of other programs, before this run adds its own
    corpus, corpus_missing = None, ""
    try:  # before the model loads: a corpus asked for by name that cannot be had fails at once
        corpus = corpus_mod.resolve_corpus(args.text, args.dataset)
    except corpus_mod.CorpusUnavailable as exc:
        if args.text is not None or args.dataset is not None:
            raise
        corpus_missing = str(exc)  # not even the corpus Python ships: perplexity is skipped, with the reason
    model, tokenizer, threads = meta.load_for_eval(args.model, args.threads)
    for kv in map(resolve_kv, plan.caches):
        if is_engine(kv):
            engine_peers.check_model(kv, args.model)  # what vLLM / llama.cpp will load, or one line now
    for what, n in (("ppl context", plan.ppl_context), ("retrieval length", max(plan.lengths)),
                    ("speed context", max(plan.speed_contexts))):
        meta.check_context(model, n, what)
    check_prefill_chunk(plan.prefill_chunk, getattr(model.config.get_text_config(decoder=True),
                                                    "max_position_embeddings", None))
    print(f"kvsqueeze bench{' --quick' if plan.quick else ''}: {len(plan.caches)} caches "
          f"({', '.join(plan.caches)}), {threads} threads")
    for note in plan.skipped:
        print(f"  skipped {note}")
    chunks = None
    if corpus is not None:
        ids = corpus_mod.tokenize(corpus, tokenizer)
        chunks = corpus_mod.eval_chunks(ids, plan.ppl_context, plan.ppl_chunks)
        print(f"  corpus {corpus_mod.summary(corpus)}, {ids.numel()} tokens")
        print(f"  corpus resolution: {'; '.join(corpus.resolution)}")
    else:
        print(f"  perplexity skipped: {corpus_missing}")
        plan.skipped.append(f"perplexity: {corpus_missing}")
    expected = estimate_seconds(plan, model, chunks is not None)
    estimate = expected_time(expected, load, threads)
    print(f"  expected time: {estimate['text']}")

    results: dict[str, Any] = {"config": plan.as_dict(), "caches": []}
    kinds = describe(plan.caches)
    results["caches"] = kinds
    if chunks is not None:
        results["ppl"] = run_ppl_stage(model, chunks, plan, progress)
    results["retrieval"] = run_retrieval_stage(model, tokenizer, plan, progress)
    results["speed"] = run_speed_stage(model, plan, progress)
    results["capacity"] = run_capacity_stage(model, plan, results["speed"])
    failed = run_engine_stage(model, chunks, plan, progress, args.model, threads, results)
    results["not_measured"] = not_measured(plan, failed)
    plan.skipped += [f"{name}: {reason}" for name, reason in failed.items()]
    results["skipped"] = plan.skipped
    results["meta"] = {
        "command": meta.command_line(args), "date": meta.now(), "threads": threads,
        "machine": meta.machine_info(), "model": meta.model_info(model, args.model),
        "corpus": None if corpus is None else {**corpus.describe(), "tokens": int(ids.numel()),
                                                "evaluated_fraction_limit": corpus_mod.MAX_EVAL_FRACTION},
        "corpus_missing": corpus_missing, "retrieval_haystack": generated_haystack(), "expected_seconds": expected, "estimate": estimate,
        "load_at_start": load, "wall_seconds": time.perf_counter() - start,
    }
    return write_report(results, out_root)


def write_report(results: dict[str, Any], out_root: Path) -> Path:
    """report.md, results.json and the plots, written into a hidden folder renamed into place at the end."""
    from ..atomic_dir import staged_directory

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    final = out_root / stamp
    k = 1
    while final.exists():
        final, k = out_root / f"{stamp}-{k}", k + 1
    with staged_directory(final) as tmp:
        plots = report.write_plots(results, tmp)
        (tmp / "report.md").write_text(report.markdown(results, plots), encoding="utf-8")
        meta.write_json_atomic(tmp / "results.json", results)
    return final
