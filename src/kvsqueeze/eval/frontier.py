"""The quality frontier: at each bit budget, the best kvsqueeze cache against the best peer that fits it.

Nothing is measured here that the bench does not measure: the caches go through :func:`bench.run_ppl_stage`
(window and all-quantized protocols for kvsqueeze caches, the decode protocol for transformers' caches, with
kvsqueeze's decode column computed by the window protocol with the same prefix, which equals real decoding
through its cache) and :func:`bench.run_engine_stage` for vLLM's and llama.cpp's (all-quantized).  This module
only picks, per budget and protocol, the cache with the smallest perplexity change among those whose bits per
element of the quantized part (every scale, zero-point, centre and outlier counted, the full-precision window and
sinks not) are within the budget, and writes the table (markdown + JSON) and the plot
(:func:`report.plot_ppl_vs_bits`).  A peer that runs its own engine (vLLM, llama.cpp: other weights or kernels
than the model kvsqueeze runs) is ranked and compared by its change against its engine's own unquantized cache,
measured in the same run (``vllm:auto``, ``llamacpp:f16``); every other cache by its change against ``full``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..atomic_dir import write_file_atomic
from ..resolve import resolve_kv
from . import meta, report
from .engine_peers import reference_of

BUDGETS = (2.0, 2.5, 3.0, 3.5, 4.0, 5.0)
PEERS = ("hf-quanto-int2", "hf-quanto-int4", "hf-quanto-int2-axis1", "hf-quanto-int4-axis1", "vllm:fp8_e4m3",
         "llamacpp:q4_0", "llamacpp:q4_1")
PROTOCOLS = ("window", "all-quantized", "decode")
EPS = 1e-6  # bits compared to a budget: 3.0000001 from float sums still fits 3.0


def usable(names: list[str]) -> tuple[list[str], list[str]]:
    """The names that resolve here (a peer whose library or engine is missing does not), and one note per other."""
    from .engine_peers import check_runs_here, is_engine

    ok, skipped = [], []
    for name in dict.fromkeys(names):
        try:
            kv = resolve_kv(name)
            if is_engine(kv):
                check_runs_here([kv])
        except Exception as exc:  # noqa: BLE001 - any reason a peer cannot run here is a skip note
            skipped.append(f"{name}: {' '.join(str(exc).split())}")
        else:
            ok.append(name)
    return ok, skipped


def bits_of(r: dict[str, Any]) -> float | None:
    """Bits per element of the quantized part (vLLM: its dtype's bits, where no bytes were counted)."""
    b = r.get("quantized_bits_per_element")
    if b is None:
        b = (r.get("kv_bytes") or {}).get("quantized_bits_per_element")
    return b if b is not None else r.get("bits_per_element")


def best_at(column: dict[str, dict[str, Any]], budget: float, kinds: dict[str, str], kind: str,
            base: float | None = None) -> tuple[str, dict[str, Any]] | None:
    """The cache of ``kind`` ("preset" or "peer") in ``column`` within ``budget`` bits with the lowest perplexity
    change (:func:`report.own_delta` against ``base``; the lowest perplexity where no change can be computed)."""
    def score(name: str) -> float:
        d = report.own_delta(column, name, base)
        return column[name]["ppl"] if d is None else d

    fits = [(score(name), name) for name, r in column.items()
            if kinds.get(name) == kind and name != "full" and (b := bits_of(r)) is not None and b <= budget + EPS]
    if not fits:
        return None
    _, name = min(fits)
    return name, column[name]


def frontier_rows(results: dict[str, Any], budgets: tuple[float, ...] = BUDGETS) -> list[dict[str, Any]]:
    """Per budget and protocol: the best kvsqueeze cache and the best peer, their bits, ppl and change vs full."""
    kinds = {c["name"]: c["kind"] for c in results["caches"]}
    rows = []
    for budget in budgets:
        row: dict[str, Any] = {"budget": budget}
        for protocol in PROTOCOLS:
            column = results.get("ppl", {}).get(protocol, {})
            base = report.baseline(results, protocol)
            cell = {}
            for kind, key in (("preset", "kvsqueeze"), ("peer", "peer")):
                hit = best_at(column, budget, kinds, kind, base)
                ref = None if hit is None else reference_of(hit[0])
                cell[key] = None if hit is None else {
                    "kv": hit[0], "bits": bits_of(hit[1]), "ppl": hit[1]["ppl"],
                    "delta_percent": report.own_delta(column, hit[0], base),
                    "against": ref if ref in column else None}
            ours, peer = cell["kvsqueeze"], cell["peer"]
            if ours is None or peer is None:
                cell["kvsqueeze_ahead"] = None
            elif ours["delta_percent"] is not None and peer["delta_percent"] is not None:
                cell["kvsqueeze_ahead"] = ours["delta_percent"] < peer["delta_percent"]  # each against its own
            else:
                cell["kvsqueeze_ahead"] = ours["ppl"] < peer["ppl"]
            row[protocol] = cell
        rows.append(row)
    return rows


def _cell(c: dict[str, Any] | None) -> str:
    if c is None:
        return "–"
    against = f" vs {c['against']}" if c.get("against") else ""
    d = "" if c["delta_percent"] is None else f" ({c['delta_percent']:+.2f}%{against})"
    name = Path(c["kv"]).name if "/" in c["kv"] else c["kv"]  # an artifact directory: its name
    return f"`{name}` {c['bits']:.3f} b: {c['ppl']:.3f}{d}"


def markdown(rows: list[dict[str, Any]], results: dict[str, Any]) -> str:
    def yes(x: bool | None) -> str:
        return "–" if x is None else "yes" if x else "no"

    lines = ["| budget (bits) | window: best kvsqueeze | all-quantized: best kvsqueeze | all-quantized: best peer "
             "| kvsqueeze ahead (all-quantized) | decode: best kvsqueeze* | decode: best peer "
             "| kvsqueeze ahead (decode) |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        aq, dec = row["all-quantized"], row["decode"]
        lines.append(f"| {row['budget']:g} | {_cell(row['window']['kvsqueeze'])} | {_cell(aq['kvsqueeze'])} | "
                     f"{_cell(aq['peer'])} | {yes(aq['kvsqueeze_ahead'])} | {_cell(dec['kvsqueeze'])} | "
                     f"{_cell(dec['peer'])} | {yes(dec['kvsqueeze_ahead'])} |")
    base = {p: report.baseline(results, p) for p in PROTOCOLS}
    lines += ["", "Full precision: " + ", ".join(f"{p} {b:.3f}" for p, b in base.items() if b is not None) + ".",
              "Bits: per element of the quantized part, every scale, zero-point, centre and outlier counted "
              "(measured on the real cache); the full-precision window, sinks and a peer's residual are not.",
              "*decode column of kvsqueeze caches: the window protocol with the same prefix (equal to decoding "
              "through the real cache); transformers' peers decode token by token. Peers with an engine of their "
              "own (vLLM, llama.cpp) keep no full-precision window: they appear in the all-quantized columns, "
              "their change against their engine's own unquantized cache (`vs ...`), which is what kvsqueeze's "
              "change against `full` is compared with.", ""]
    if results.get("skipped"):
        lines += ["Skipped: " + "; ".join(results["skipped"]), ""]
    return "\n".join(lines)


def _same_setting(previous: dict[str, Any], chunks: Any, decode_tokens: int, info: dict[str, Any]) -> None:
    cfg, corpus = previous["config"], previous.get("meta", {}).get("corpus", {})
    here = (int(chunks.shape[1]), int(chunks.shape[0]), decode_tokens, (info.get("corpus") or {}).get("sha256"),
            (info.get("model") or {}).get("name"))
    there = (cfg["context"], cfg["chunks"], cfg["decode_tokens"], corpus.get("sha256"),
             previous.get("meta", {}).get("model", {}).get("name"))
    if here != there:
        raise ValueError(f"--add-to: the earlier frontier was measured with (context, chunks, decode tokens, corpus "
                         f"sha256, model) = {there}, this run with {here}; measure into a new --out")


def run_frontier(model: Any, chunks: Any, names: list[str], budgets: tuple[float, ...], decode_tokens: int,
                 out: Path, progress: bool = False, model_source: str | None = None, threads: int = 1,
                 info: dict[str, Any] | None = None, previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """Measure ``names`` (plus ``full``) on ``chunks`` and write frontier.md, frontier.json and frontier.png.

    ``previous``: an earlier frontier.json of the same chunks, model and decode tokens; its measurements are
    kept and only the caches it lacks are measured (a calibration artifact added to an existing frontier)."""
    from .bench import make_plan, not_measured, run_engine_stage, run_ppl_stage
    from .peers import describe

    info = info or {}
    # an engine peer's own unquantized cache goes with it: its rows are read against it
    refs = [r for n in names if (r := reference_of(n)) is not None and r != n]
    wanted = list(dict.fromkeys(["full", *names, *refs]))
    done: set[str] = set()
    if previous is not None:
        _same_setting(previous, chunks, decode_tokens, info)
        done = {c["name"] for c in previous["caches"]}
    # only what is still to measure must be usable here (an earlier run's vLLM row stays without vLLM)
    fresh, skipped = usable([n for n in wanted if n not in done])
    names = [n for n in wanted if n in done or n in fresh]
    todo = [n for n in names if n not in done]
    plan = make_plan(True, todo or ["full"], ppl_context=int(chunks.shape[1]), ppl_chunks=int(chunks.shape[0]),
                     ppl_decode_tokens=decode_tokens)
    results: dict[str, Any] = {"config": {"budgets": list(budgets), "caches": names,
                                          "context": plan.ppl_context, "chunks": plan.ppl_chunks,
                                          "decode_tokens": decode_tokens},
                               "caches": describe(todo), "skipped": skipped, "speed": {}, "ppl": {}}
    if todo:
        results["ppl"] = run_ppl_stage(model, chunks, plan, progress)
    failed = run_engine_stage(model, chunks, plan, progress, model_source, threads, results) if todo else {}
    results["not_measured"] = not_measured(plan, failed) if todo else {}
    results["skipped"] += [f"{n}: {why}" for n, why in failed.items()]
    if previous is not None:  # earlier measurements first, this run's added
        old = [c for c in previous["caches"]]
        results["caches"] = old + [c for c in results["caches"] if c["name"] not in done]
        results["config"]["caches"] = [c["name"] for c in results["caches"]]
        for protocol, column in previous.get("ppl", {}).items():
            results["ppl"][protocol] = {**column, **{k: v for k, v in results["ppl"].get(protocol, {}).items()
                                                     if k not in column}}
        results["not_measured"] = {**previous.get("not_measured", {}), **results["not_measured"]}
        results["skipped"] = list(dict.fromkeys(previous.get("skipped", []) + results["skipped"]))
    results["frontier"] = frontier_rows(results, budgets)
    results["meta"] = {"threads": threads, "machine": meta.machine_info(), "date": meta.now(), **info}
    write_file_atomic(out / "frontier.md", markdown(results["frontier"], results))
    meta.write_json_atomic(out / "frontier.json", results)
    plot = report.plot_ppl_vs_bits(results, out / "frontier.png", bits_field="quantized_bits_per_element")
    results["plot"] = None if plot is None else str(plot)
    return results

