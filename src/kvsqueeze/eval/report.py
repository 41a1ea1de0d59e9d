"""The bench report: one markdown table (paste-ready for BENCHMARKS.md), results.json and PNG plots.

Everything here reads the bench's result dictionary; nothing is measured.  Plots use matplotlib's Agg backend
so they render on machines without a display.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .engine_peers import reference_of

PPL_COLUMNS = (("window", "ppl window"), ("all-quantized", "ppl all-quantized"), ("decode", "ppl decode"))
MiB = 2**20


# ------------------------------------------------------------------------------------------------ numbers
def baseline(results: dict[str, Any], protocol: str) -> float | None:
    """Full-precision ppl of a column: the ``full`` preset, else transformers' DynamicCache."""
    col = results.get("ppl", {}).get(protocol, {})
    for name in ("full", "hf-dynamic"):
        if name in col:
            return col[name]["ppl"]
    return None


def delta(ppl: float, base: float | None) -> float | None:
    return None if base is None else 100.0 * (ppl / base - 1.0)


def own_delta(column: dict[str, dict[str, Any]], name: str, base: float | None) -> float | None:
    """A cache's perplexity change in percent: against its engine's own unquantized cache where it has one and
    it was measured in ``column`` (``llamacpp:q4_0`` against ``llamacpp:f16``: other weights or kernels than the
    model the other rows run), else against ``base``."""
    ref = reference_of(name)
    if ref is not None and ref in column:
        base = column[ref]["ppl"]
    return delta(column[name]["ppl"], base)


def _fmt_delta(d: float | None) -> str:
    if d is None:
        return ""
    if abs(d) < 0.005:
        return " (±0.00%)"
    return f" ({d:+.2f}%)" if abs(d) < 1000 else f" ({d:+.0f}%)"


def _fmt_ppl(x: float) -> str:
    return f"{x:.3f}" if x < 100 else f"{x:.1f}" if x < 10000 else f"{x:.3g}"


VLLM_REFERENCE = "vllm:auto"  # vLLM's unquantized cache: the second reference of vLLM's quantized rows
LLAMACPP_REFERENCE = "llamacpp:f16"  # likewise llama.cpp's default cache (engine_peers.REFERENCES)


def not_available(results: dict[str, Any], name: str, column: str) -> str:
    """An empty cell: "n/a", with the short reason the bench recorded for it (``results["not_measured"]``)."""
    reason = results.get("not_measured", {}).get(name, {}).get(column)
    return f"n/a ({reason})" if reason else "n/a"


def ppl_cell(results: dict[str, Any], protocol: str, name: str) -> str:
    col = results.get("ppl", {}).get(protocol, {})
    r = col.get(name)
    if r is None:
        return not_available(results, name, protocol)
    mark = "*" if r.get("emulated_by") else ""
    cell = _fmt_ppl(r["ppl"]) + mark + _fmt_delta(delta(r["ppl"], baseline(results, protocol)))
    ref_name = reference_of(name)
    ref = None if ref_name is None else col.get(ref_name)
    if ref is not None and name != ref_name:  # an engine's own loss, against its own unquantized cache
        cell += f" ({delta(r['ppl'], ref['ppl']):+.2f}% vs {ref_name})"
    return cell


def storage(results: dict[str, Any], name: str) -> dict[str, Any] | None:
    """Bytes for the table: the speed run at the largest context, else the first ppl measurement."""
    speed = results.get("speed", {}).get(name, {})
    if speed:
        return speed[max(speed, key=int)].get("kv_bytes")
    for protocol in ("decode", "window", "all-quantized"):
        r = results.get("ppl", {}).get(protocol, {}).get(name)
        if r is not None:
            return r.get("kv_bytes")
    return None


def _fmt_bits(b: dict[str, Any] | None) -> str:
    if b is None or b["bits_per_element"] is None:
        return "n/a"
    q = b["quantized_bits_per_element"]
    return f"{b['bits_per_element']:.2f}" + (f" ({q:.2f})" if q is not None else "")


def retrieval_cell(results: dict[str, Any], name: str) -> str:
    r = results.get("retrieval", {}).get(name)
    if r is None:
        return not_available(results, name, "retrieval")
    hits = sum(c["correct"] for c in r["cells"])
    return f"{100 * hits / len(r['cells']):.0f}% ({hits}/{len(r['cells'])})"


def _speed(results: dict[str, Any], name: str, ctx: int, field: str, scale: float = 1.0, digits: int = 1) -> str:
    r = results.get("speed", {}).get(name, {}).get(str(ctx))
    if r is None:
        return not_available(results, name, "speed")
    if r.get(field) is None:
        return not_available(results, name, "peak_rss" if field in ("peak_rss_bytes", "peak_rss_delta_bytes") else field)
    return f"{r[field] / scale:.{digits}f}"


def _path_cell(results: dict[str, Any], name: str, ctx: int) -> str:
    r = results.get("speed", {}).get(name, {}).get(str(ctx))
    if not isinstance(r, dict):
        return not_available(results, name, "speed")
    return r.get("attention_path") or r.get("engine") or "n/a"  # vLLM's rows name their engine


# ------------------------------------------------------------------------------------------------ markdown
def markdown(results: dict[str, Any], plots: Sequence[str] = ()) -> str:
    meta, cfg = results["meta"], results["config"]
    ctxs = [int(c) for c in cfg["speed_contexts"]]
    lo, hi = min(ctxs), max(ctxs)
    m, mach = meta["model"], meta["machine"]
    v = mach["versions"]
    out = [
        f"# kvsqueeze bench{' --quick' if cfg['quick'] else ''}: {m['name']}",
        "",
        f"- Command: `{meta['command']}`",
        f"- Date: {meta['date']}; wall time {meta['wall_seconds'] / 60:.1f} min (estimated up front: "
        f"{_estimate(meta)})",
        f"- Machine: {mach['cpu']}, {mach['cpus_available']} CPUs available, {mach['memory_gib']} GiB RAM, "
        f"{mach['platform']}, {'GPU ' + mach['gpu'] if mach['gpu'] else 'no GPU used'}{_load(meta)}",
        f"- Threads: {meta['threads']} (torch intra-op, fixed for the whole run)",
        f"- Software: kvsqueeze {v.get('kvsqueeze')}, torch {v.get('torch')}, transformers {v.get('transformers')}, "
        f"optimum-quanto {v.get('optimum-quanto') or 'not installed'}, Python {mach['python']}",
        f"- Model: {m['architecture']}, {m['num_layers']} layers, {m['num_heads']} heads / {m['num_kv_heads']} KV "
        f"heads, head_dim {m['head_dim']}, {m['dtype']} ({m['parameters'] / 1e6:.1f}M parameters)",
    ]
    corpus = meta.get("corpus")
    if corpus:
        what = f"{corpus['description']}, " if corpus.get("description") else ""
        out.append(f"- Corpus: {corpus['name']} ({what}{corpus['source']}, sha256 `{corpus['sha256'][:16]}…`, "
                   f"{corpus['tokens']} tokens); perplexity over {cfg['ppl_chunks']} consecutive chunks of "
                   f"{cfg['ppl_context']} tokens from the start (stride {cfg['ppl_context']}); the last 10% "
                   f"of the corpus is never evaluated (reserved for calibration)")
        if corpus.get("resolution"):
            out.append(f"- Corpus resolution (in order: --text, $KVSQUEEZE_DATA, local cache, hub, the corpus "
                       f"Python ships): {'; '.join(corpus['resolution'])}")
    else:
        out.append(f"- Corpus: none available, perplexity skipped. {meta.get('corpus_missing', '')}")
    out += ["", "## Results", ""]
    head = ["cache", "kind", "bits/element (quantized part)", "KV bytes/token",
            *[label for _, label in PPL_COLUMNS[:2]], f"ppl decode (last {cfg['ppl_decode_tokens']})", "retrieval", f"prefill s @{hi}",
            f"decode ms/token @{lo}", f"decode ms/token @{hi}", f"of it in attention @{hi}",
            f"peak RSS growth MiB @{hi} (of it KV)",
            f"attention path @{hi}"]
    out.append("| " + " | ".join(head) + " |")
    out.append("|" + "---|" * len(head))
    for c in results["caches"]:
        name = c["name"]
        b = storage(results, name)
        row = [f"`{name}`", c["kind"], _fmt_bits(b), "n/a" if b is None else f"{b['bytes_per_token']:.0f}",
               *[ppl_cell(results, p, name) for p, _ in PPL_COLUMNS], retrieval_cell(results, name),
               _speed(results, name, hi, "prefill_s", digits=2), _speed(results, name, lo, "decode_ms_per_token"),
               _speed(results, name, hi, "decode_ms_per_token"),
               _speed(results, name, hi, "decode_attention_ms_per_token"), _growth_cell(results, name, hi),
               _path_cell(results, name, hi)]
        out.append("| " + " | ".join(row) + " |")
    out += ["", *_notes(results), ""]
    if results.get("capacity"):
        out += _capacity_table(results)
    if results.get("retrieval"):
        out += _retrieval_table(results)
    if plots:
        out += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    if results.get("skipped"):
        out += ["## Not measured", ""] + [f"- {s}" for s in results["skipped"]] + [""]
    return "\n".join(out)


def _estimate(meta: dict[str, Any]) -> str:
    est = meta.get("estimate")
    if not est:
        return f"{meta['expected_seconds'] / 60:.0f} min"
    idle = est.get("idle_seconds")
    if est.get("busy") and idle is not None:
        return f"{est['seconds'] / 60:.1f} min at the load then, {idle / 60:.1f} min if idle"
    return f"{est['seconds'] / 60:.1f} min"


def _load(meta: dict[str, Any]) -> str:
    load = meta.get("load_at_start") or {}
    if load.get("other_load") is None:
        return ""
    busy = (meta.get("estimate") or {}).get("busy")
    return (f"; load average {load['load_average_1min']:.1f} at the start"
            + (" (other programs were running: timings are slower than on an idle machine)" if busy else ""))


def _notes(results: dict[str, Any]) -> list[str]:
    cfg = results["config"]
    ctxs = sorted(int(c) for c in cfg["speed_contexts"])
    tail = cfg["ppl_decode_tokens"]
    notes = [
        "How to read it:",
        "- Caches: `kind` preset = kvsqueeze's QuantizedCache; peer = transformers' own cache "
        "(DynamicCache, QuantizedCache with the quanto or fp8 backend), vLLM's (`vllm:<kv_cache_dtype>`) or "
        "llama.cpp's (`llamacpp:<type>`), measured in the same run.",
        "- bits/element and KV bytes/token: every byte the cache holds (codes, scales and zero-points, "
        "full-precision window and sinks, a peer's residual) over the K+V elements / tokens it stores, measured "
        f"on the real cache after the {ctxs[-1]}-token speed prompt and its decode steps; in parentheses the "
        "quantized part alone.",
        "- ppl window: one pass per chunk, each query sees exactly what the real cache would give it "
        "(quantized history, full-precision window and sinks), every token of the chunk scored.",
        "- ppl all-quantized: every key and value quantized, the current token's included, no window, no "
        "sinks (the KVQuant / llama.cpp protocol); per-channel key groups are quantized causally "
        "(each query's own partial group uses parameters from its tokens up to the query only).",
        f"- ppl decode: the first {cfg['ppl_context'] - tail} tokens of each chunk are prefilled, the last "
        f"{tail} are scored one step at a time through the cache: real token-by-token decoding, except cells "
        "marked *, kvsqueeze presets computed with the window protocol and the same prefix, which equals "
        "real decoding through kvsqueeze's cache (tested to 1e-3 in tests/eval; `--exact-decode` decodes).",
        "- Δ: relative to the full-precision row of the same column (`full`, else `hf-dynamic`). transformers' "
        "caches have no window / all-quantized figures: those protocols emulate kvsqueeze's own storage.",
    ]
    vllm = [c for c in results["caches"] if c["name"].startswith("vllm:")]
    if vllm:
        notes.append(_vllm_note(results, vllm))
    if any(c["name"].startswith("llamacpp:") for c in results["caches"]):
        notes.append(_llamacpp_note(results))
    if results.get("retrieval"):
        r0 = next(iter(results["retrieval"].values()))
        notes.append(f"- retrieval: passkey accuracy over lengths {', '.join(map(str, r0['lengths']))} tokens, "
                     f"depths {', '.join(f'{d:g}' for d in r0['depths'])}, {r0['trials']} trial(s) each; "
                     f"{r0['haystack']} haystack, '{r0['format']}' prompt, greedy decoding through the cache, "
                     "exact match of the first number.")
    notes.append(f"- speed: random-token prompts of {' and '.join(map(str, ctxs))} tokens, then "
                 f"{cfg['speed_decode_tokens']} greedy decode steps (model forward + cache, median per step); "
                 f"prompts prefilled {cfg.get('prefill_chunk') or 'in one pass'}"
                 f"{' tokens per forward pass' if cfg.get('prefill_chunk') else ''}; peak RSS growth is the rise of "
                 "the process's resident memory high-water mark during that measurement (reset first, freed memory "
                 "handed back to the OS first), beside the cache's own bytes at its end.")
    return notes


def _growth_cell(results: dict[str, Any], name: str, ctx: int) -> str:
    r = results.get("speed", {}).get(name, {}).get(str(ctx))
    if not r or r.get("peak_rss_delta_bytes") is None:
        return _speed(results, name, ctx, "peak_rss_delta_bytes", MiB, 0)
    return f"{r['peak_rss_delta_bytes'] / MiB:.0f} ({r['kv_bytes']['total'] / MiB:.1f})"


def _capacity_table(results: dict[str, Any]) -> list[str]:
    cap = results["capacity"]
    first = next(iter(cap.values()))
    budget = first["budget_bytes"] / 2**30
    base = cap.get("full") or cap.get("hf-dynamic")
    out = [f"## Capacity in {budget:g} GiB", "",
           f"| cache | KV bytes/token | fixed MiB | transient MiB/sequence | longest context (tokens) | x "
           f"{'full' if 'full' in cap else 'hf-dynamic'} | sequences of {first['batch_context']} tokens | x |",
           "|---|---|---|---|---|---|---|---|"]
    for name, c in cap.items():
        xt = f"{c['max_tokens'] / base['max_tokens']:.1f}" if base and base["max_tokens"] else "-"
        xb = f"{c['max_batch'] / base['max_batch']:.1f}" if base and base["max_batch"] else "-"
        longest = f"{c['max_tokens']}" + (f" (model: {c['max_context']})" if c["limited_by_model_positions"] else "")
        out.append(f"| `{name}` | {c['bytes_per_token']:.0f} | {c['fixed_bytes'] / MiB:.1f} | "
                   f"{c['transient_bytes_per_sequence'] / MiB:.1f} | {longest} | {xt} | {c['max_batch']} | {xb} |")
    out += ["", f"Projected, not run: a sequence of n tokens costs transient + fixed + n x bytes/token; the cache's "
                f"bytes come from exact fills of a real cache at two lengths, the transient (the peak beyond the "
                f"cache, per sequence) from the {first['transient_measured_at']}-token speed run; the longest "
                f"context is what the budget holds for one sequence, the model's position limit in parentheses "
                f"(kvsqueeze.eval.capacity; benchmarks/memory_capacity.py checks a projection against a measured "
                f"peak).", ""]
    return out


def plot_capacity(results: dict[str, Any], path: Path) -> Path | None:
    cap = results.get("capacity")
    if not cap:
        return None
    plt = _plt()
    names = list(cap)
    first = cap[names[0]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.35 * len(names) + 1.6))
    axes[0].barh(names, [cap[n]["max_tokens"] / 1000 for n in names], color="#4c72b0")
    axes[0].set_xlabel(f"thousand tokens of one sequence in {first['budget_bytes'] / 2**30:g} GiB")
    axes[1].barh(names, [cap[n]["max_batch"] for n in names], color="#55a868")
    axes[1].set_xlabel(f"sequences of {first['batch_context']} tokens")
    for ax in axes:
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle("Capacity of the memory budget (projected from measured peaks and exact cache bytes)", fontsize=10)
    fig.tight_layout()
    _savefig(fig, path)
    plt.close(fig)
    return path


def _vllm_note(results: dict[str, Any], caches: list[dict[str, Any]]) -> str:
    engines = {r["engine"] for col in results.get("ppl", {}).values() for n, r in col.items() if n.startswith("vllm:")}
    engines |= {r["engine"] for n, per in results.get("speed", {}).items() if n.startswith("vllm:")
                for r in per.values()}
    weights = caches[0].get("weights", "bf16")
    return (f"- `vllm:*` rows: {', '.join(sorted(engines)) or 'vLLM'} in its own process on the same model "
            f"({weights} weights, vLLM's kernels; other rows run the model in {results['meta']['model']['dtype']}), "
            "the same chunks and prompts. ppl: `prompt_logprobs`, every token's K/V written to vLLM's cache and read "
            "back from it: the all-quantized protocol only (vLLM keeps no full-precision window, so window and "
            f"decode are n/a); in parentheses also the change vs `{VLLM_REFERENCE}`, vLLM's unquantized cache. "
            "bits/element and KV bytes/token are computed, not measured in-process (vLLM preallocates a paged pool "
            "in its own process): dtype bits (auto: the weights' dtype) x tokens x layers x KV heads x head_dim x 2, "
            "plus one fp32 k_scale and v_scale per layer for fp8. speed: prefill = the time until the batch's "
            "first token; decode = time from the first token to the last / decode "
            "steps (time per output token, one run, not a median), vLLM's scheduling included; peak RSS "
            "is n/a (vLLM's processes are not this one). Retrieval is not run through vLLM.")


def _llamacpp_note(results: dict[str, Any]) -> str:
    engines = {r["engine"] for col in results.get("ppl", {}).values() for n, r in col.items()
               if n.startswith("llamacpp:")}
    engines |= {r["engine"] for n, per in results.get("speed", {}).items() if n.startswith("llamacpp:")
                for r in per.values()}
    return (f"- `llamacpp:*` rows: {', '.join(sorted(engines)) or 'llama.cpp'} in this process on the model's GGUF "
            "file (its weights as the file stores them and llama.cpp's kernels, flash attention on; other rows run "
            f"the model in {results['meta']['model']['dtype']} through transformers), the same chunks and prompts. "
            "ppl: each chunk evaluated at once; llama.cpp converts every micro-batch's K/V to the cache type before "
            "attention reads them back: the all-quantized protocol only (window and decode are n/a); in "
            f"parentheses also the change vs `{LLAMACPP_REFERENCE}`, llama.cpp's unquantized cache. Recent llama.cpp "
            "rotates quantized K/V by a Hadamard matrix (each row's settings say whether it was on). bits/element "
            "and KV bytes/token are computed from ggml's blocks (32 elements with an fp16 scale, and an fp16 "
            "minimum for the _1 types: q8_0 8.5, q5_1 6.0, q5_0 5.5, q4_1 5.0, q4_0 and iq4_nl 4.5 bits), not "
            "measured. speed: one sequence, the prompt in one call, then the median greedy step; peak RSS is n/a.")


def _retrieval_table(results: dict[str, Any]) -> list[str]:
    r0 = next(iter(results["retrieval"].values()))
    cols = [(n, d) for n in r0["lengths"] for d in r0["depths"]]
    out = ["## Retrieval accuracy per (length, depth)", "",
           "| cache | " + " | ".join(f"{n}@{d:g}" for n, d in cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for name, r in results["retrieval"].items():
        grid = r["accuracy"]
        cells = [grid[r["depths"].index(d)][r["lengths"].index(n)] for n, d in cols]
        out.append(f"| `{name}` | " + " | ".join(f"{100 * a:.0f}%" for a in cells) + " |")
    return out + [""]


# ------------------------------------------------------------------------------------------------ plots
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not dominated by another with fewer (or equal) bits and lower (or equal) ppl delta."""
    front, best = [], math.inf
    for x, y in sorted(points):
        if y < best:
            front.append((x, y))
            best = y
    return front


def plot_ppl_vs_bits(results: dict[str, Any], path: Path, bits_field: str = "bits_per_element") -> Path | None:
    """Change of perplexity against bits per element, one panel per protocol.  ``bits_field``: the kv_bytes
    field on the x axis (``quantized_bits_per_element``: the quantized part alone, as the frontier's budgets)."""
    panels = [(p, label) for p, label in (("decode", "decode protocol (all caches)"),
                                          ("window", "window protocol (kvsqueeze)"),
                                          ("all-quantized", "all-quantized protocol (kvsqueeze, vLLM, llama.cpp)"))
              if results.get("ppl", {}).get(p)]
    if not panels:
        return None
    plt = _plt()
    from matplotlib import ticker

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    kinds = {c["name"]: c["kind"] for c in results["caches"]}
    for ax, (protocol, label) in zip(axes[0], panels):
        base = baseline(results, protocol)
        pts = []
        for name, r in results["ppl"][protocol].items():
            bits, d = (r.get("kv_bytes") or {}).get(bits_field), own_delta(results["ppl"][protocol], name, base)
            if bits is None or d is None:
                continue
            pts.append((bits, d))
            peer = kinds.get(name) == "peer"
            ax.scatter([bits], [d], marker="^" if peer else "o", s=45, color="tab:red" if peer else "tab:blue",
                       zorder=3)
            point = Path(name).name if "/" in name else name  # an artifact directory: its name
            ax.annotate(point, (bits, d), fontsize=7, xytext=(3, 3), textcoords="offset points")
        front = pareto_front(pts)
        if len(front) > 1:
            ax.plot(*zip(*front), "--", color="gray", lw=1, zorder=2, label="Pareto front")
            ax.legend(fontsize=7)
        if max((abs(y) for _, y in pts), default=0) > 50:  # a collapse next to +0.1%: keep both readable
            ax.set_yscale("symlog", linthresh=1.0)
            ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.axhline(0, color="black", lw=0.5)
        ax.set_xlabel("bits per element (all metadata and full-precision parts)" if bits_field == "bits_per_element"
                      else "bits per element of the quantized part (all metadata)")
        ax.set_ylabel("ppl change vs full precision (%; an engine peer: vs its own)")
        ax.set_title(label, fontsize=9)
    fig.suptitle("Perplexity vs storage (circles: kvsqueeze presets, triangles: peers)", fontsize=10)
    fig.tight_layout()
    _savefig(fig, path)
    plt.close(fig)
    return path


def _by_context(results: dict[str, Any], field: str, scale: float) -> dict[str, tuple[list[int], list[float]]]:
    out = {}
    for name, per_ctx in results.get("speed", {}).items():
        ctxs = sorted(int(c) for c in per_ctx)
        xs, vals = [], []
        for c in ctxs:
            v = per_ctx[str(c)]
            for key in field.split("."):
                v = None if v is None else v.get(key)
            if v is not None:  # e.g. vLLM's peak RSS: not this process's
                xs.append(c)
                vals.append(v / scale)
        if xs:
            out[name] = (xs, vals)
    return out


def _line_plot(ax, series: dict[str, tuple[list[int], list[float]]], kinds: dict[str, str], ylabel: str) -> None:
    for name, (x, y) in series.items():
        ax.plot(x, y, "^--" if kinds.get(name) == "peer" else "o-", label=name, lw=1.2, ms=4)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(ylabel)
    ax.ticklabel_format(useOffset=False, style="plain")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_decode_vs_context(results: dict[str, Any], path: Path) -> Path | None:
    series = _by_context(results, "decode_ms_per_token", 1.0)
    if not series:
        return None
    plt = _plt()
    kinds = {c["name"]: c["kind"] for c in results["caches"]}
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    _line_plot(ax, series, kinds, "decode ms/token (median)")
    ax.set_title(f"Decode time per token, {results['meta']['threads']} threads", fontsize=10)
    fig.tight_layout()
    _savefig(fig, path)
    plt.close(fig)
    return path


def plot_memory_vs_context(results: dict[str, Any], path: Path) -> Path | None:
    rss = _by_context(results, "peak_rss_bytes", MiB)
    if not rss:
        return None
    plt = _plt()
    kinds = {c["name"]: c["kind"] for c in results["caches"]}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    _line_plot(axes[0], rss, kinds, "peak resident memory (MiB, weights included)")
    _line_plot(axes[1], _by_context(results, "kv_bytes.total", MiB), kinds, "KV cache bytes (MiB)")
    axes[0].set_title("Peak RSS during prefill + decode", fontsize=10)
    axes[1].set_title("Bytes held by the cache", fontsize=10)
    fig.tight_layout()
    _savefig(fig, path)
    plt.close(fig)
    return path


def plot_retrieval(retrieval: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """One accuracy heat-map (depth x length) per cache."""
    if not retrieval:
        return None
    plt = _plt()
    n = len(retrieval)
    cols = min(n, 4)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols + 1, 2.8 * rows), squeeze=False, layout="constrained")
    im = None
    for ax, (name, r) in zip(axes.flat, retrieval.items()):
        im = ax.imshow(r["accuracy"], vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(r["lengths"])), [str(x) for x in r["lengths"]], fontsize=7)
        ax.set_yticks(range(len(r["depths"])), [f"{d:g}" for d in r["depths"]], fontsize=7)
        for i, row in enumerate(r["accuracy"]):
            for j, a in enumerate(row):
                ax.text(j, i, f"{100 * a:.0f}", ha="center", va="center", fontsize=7)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("length (tokens)", fontsize=8)
        ax.set_ylabel("depth", fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="passkey accuracy")
    _savefig(fig, path)
    plt.close(fig)
    return path


def write_plots(results: dict[str, Any], folder: Path) -> list[str]:
    made = [plot_ppl_vs_bits(results, folder / "ppl_vs_bits.png"),
            plot_decode_vs_context(results, folder / "decode_vs_context.png"),
            plot_memory_vs_context(results, folder / "memory_vs_context.png"),
            plot_capacity(results, folder / "capacity.png"),
            plot_retrieval(results.get("retrieval", {}), folder / "retrieval.png")]
    return [str(p) for p in made if p is not None]


def _savefig(fig: Any, path: str | Path) -> None:
    """Atomically: a plot is complete or absent (the format comes from ``path``'s suffix, not the staging name)."""
    from ..atomic_dir import staged_file

    with staged_file(path) as tmp:
        fig.savefig(tmp, dpi=110, format=Path(path).suffix.lstrip(".") or "png")
