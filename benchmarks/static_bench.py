"""Static-shape KV path on the embedded SmolLM2-135M: quality, speed, copies and memory, as markdown tables.

    PYTHONPATH=src python benchmarks/static_bench.py [--max-len 256] [--new-tokens 128] [--long-tokens 1000]

* greedy agreement over ``--new-tokens`` tokens: ONNX Runtime float static path vs transformers' ``generate``;
  int8-static vs the float static path and vs kvsqueeze's own int8 cache (first divergence, if any);
* decode tokens/s and peak RSS of transformers' generate, the same static step run eagerly in PyTorch, and
  ONNX Runtime (float and int8-static); every path runs in its own fresh process, so RSS is that path's alone
  (the ONNX Runtime processes do not import torch);
* window copies and bytes moved per ``--long-tokens`` generated tokens (sliding past S) for reserve 2(S-1),
  1.5(S-1) and the naive manager that shifts the window every token;
* the seed's buffer formula for Llama-7B and this model.

The exported graphs are cached under ~/.cache/kvsqueeze/onnx (the export takes about a minute per format).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

PROMPT = "The printing press changed Europe in the fifteenth century because"


# ------------------------------------------------------------------------------------------------ child jobs
def _rss() -> dict:
    import psutil

    return {"rss_mb": psutil.Process().memory_info().rss / 2**20,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def job_prepare(max_len: int, threads: int) -> dict:
    """Load the model once, tokenize the prompt, calibrate and export the graphs that are missing."""
    from kvsqueeze.engines.onnx_export import (
        default_onnx_dir,
        export_static_graphs,
        model_fingerprint,
        read_meta_json,
    )
    from kvsqueeze.engines.static_calibration import calibrate_static, calibration_text
    from kvsqueeze.models import load_model, set_threads

    set_threads(threads)
    model, tok = load_model(progress=False)
    fp = model_fingerprint(model)
    text, source = calibration_text()
    calib_ids = tok(text, add_special_tokens=False)["input_ids"]
    quant = calibrate_static(model, calib_ids, bits=8)
    dirs = {}
    for kv, q in (("float", None), ("int8-static", quant)):
        d = default_onnx_dir(fp, max_len, kv)
        d = d.with_name(d.name + "-bench")  # its own folder: the CLI keys its graphs by calibration text
        meta = read_meta_json(d)
        if meta is None or meta.get("kvsqueeze.quant_digest", "") != (q.digest() if q else ""):
            t0 = time.perf_counter()
            export_static_graphs(model, d, max_len, quant=q)
            print(f"exported {kv} graphs in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        dirs[kv] = str(d)
    quant.save(os.path.join(dirs["int8-static"], "bench_quant.npz"))
    ids = tok(PROMPT)["input_ids"]
    return {"dirs": dirs, "prompt_ids": list(ids), "calib_source": source, "calib_tokens": quant.meta["tokens"],
            "pad_id": tok.pad_token_id}


def job_hf(prompt_ids: list[int], n: int, threads: int, spec: str | None) -> dict:
    """transformers' generate (DynamicCache, or kvsqueeze's QuantizedCache with ``spec``), greedy, no EOS stop."""
    import torch
    from transformers import LogitsProcessorList

    from kvsqueeze.models import load_model, set_threads

    set_threads(threads)
    model, tok = load_model(progress=False)
    ids = torch.tensor([prompt_ids])

    stamps: list[float] = []

    def stamp(input_ids, scores):  # a logits processor: called once per generated token, just before choosing it
        stamps.append(time.perf_counter())
        return scores

    def gen(k: int):
        stamps.clear()
        kw = dict(max_new_tokens=k, min_new_tokens=k, do_sample=False, eos_token_id=None, top_p=None, top_k=None,
                  temperature=None, pad_token_id=tok.pad_token_id, return_dict_in_generate=True, output_logits=True,
                  logits_processor=LogitsProcessorList([stamp]))
        if spec:
            from kvsqueeze.adapter import QuantizedCache, cache_kwargs

            kw |= cache_kwargs(model, QuantizedCache(model.config, spec))
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, **kw)
        return out, t0

    gen(4)  # warm-up
    out, t0 = gen(n)
    # decode rate between the first and the last token's logits: n - 1 decode steps
    return {"tokens": out.sequences[0, len(prompt_ids):].tolist(), "logits": [x.numpy() for x in out.logits],
            "tps": (n - 1) / (stamps[-1] - stamps[0]), "prefill_ms": (stamps[0] - t0) * 1000, **_rss()}


def job_torch_static(prompt_ids: list[int], n: int, max_len: int, threads: int, pad_id: int) -> dict:
    """The exported step modules, run eagerly in PyTorch on the manager's buffers (float)."""
    from kvsqueeze.engines.static_generation import greedy_generate
    from kvsqueeze.engines.torch_static import TorchStaticEngine
    from kvsqueeze.models import load_model, set_threads

    set_threads(threads)
    model, _ = load_model(progress=False)
    eng = TorchStaticEngine(model, max_len)
    greedy_generate(eng, eng.make_manager(), [prompt_ids], 4, pad_token_id=pad_id)  # warm-up
    m = eng.make_manager()
    r = greedy_generate(eng, m, [prompt_ids], n, pad_token_id=pad_id)
    return {"tokens": r.tokens[0], "tps": r.decode_tokens_per_s, "prefill_ms": r.prefill_s * 1000,
            "kv_bytes": m.nbytes, **_rss()}


def job_ort(folder: str, prompt_ids: list[int], n: int, threads: int, pad_id: int, reserve: float = 2.0,
            naive: bool = False, on_full: str = "stop", keep_logits: bool = False, share_weights: bool = True) -> dict:
    from kvsqueeze.engines.onnx_runner import OrtStaticEngine
    from kvsqueeze.engines.static_generation import greedy_generate

    eng = OrtStaticEngine(folder, threads=threads, share_weights=share_weights)
    greedy_generate(eng, eng.make_manager(), [prompt_ids], 4, pad_token_id=pad_id)  # warm-up
    m = eng.make_manager(reserve, on_full=on_full, naive=naive)
    r = greedy_generate(eng, m, [prompt_ids], n, pad_token_id=pad_id, keep_logits=keep_logits)
    out = {"tokens": r.tokens[0], "tps": r.decode_tokens_per_s, "prefill_ms": r.prefill_s * 1000,
           "steps": r.decode_steps, "stats": r.stats, "kv_bytes": m.nbytes, "reserved": m.reserved,
           "torch_loaded": "torch" in sys.modules, **_rss()}
    if keep_logits:
        out["logits"] = r.logits  # [1, vocab] per token
    return out


def in_child(fn, *args, **kwargs):
    """Run one job in a fresh spawned process (its own RSS, no state shared with other paths)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as ex:
        return ex.submit(fn, *args, **kwargs).result()


# ------------------------------------------------------------------------------------------------ report
def _div(ref: dict, got: dict, n: int) -> str:
    from kvsqueeze.engines.static_generation import first_divergence

    d = first_divergence(ref["tokens"][:n], got["tokens"][:n], ref.get("logits"), got.get("logits"))
    if d is None:
        return f"identical ({min(len(ref['tokens']), len(got['tokens']), n)} tokens)"
    extra = ""
    if "ref_gap" in d:
        extra = (f"; reference margin {d['ref_gap']:.3f}, logit error there {d['logit_err']:.3f}, before it "
                 f"median {d['typical_err']:.3f} / max {d['max_err']:.3f} -> "
                 f"{'tie within the error' if d['tie_within_error'] else 'NOT a tie'}")
    return f"first divergence at token {d['index']} ({d['ref_token']} vs {d['got_token']}){extra}"


def _machine(threads: int) -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    import onnxruntime
    import torch

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{cpu}, {os.cpu_count()} cores, {threads} threads, load average {load:.1f} at start; "
            f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, Python {platform.python_version()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--long-tokens", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("KVSQUEEZE_THREADS", "2")),
                    help="threads for torch and ONNX Runtime alike (default $KVSQUEEZE_THREADS or 2)")
    a = ap.parse_args()
    S, n, threads = a.max_len, a.new_tokens, a.threads
    print(f"Machine: {_machine(threads)}\n", flush=True)
    prep = in_child(job_prepare, S, threads)
    ids, pad, dirs = prep["prompt_ids"], prep["pad_id"], prep["dirs"]
    if len(ids) + n > S:
        raise SystemExit(f"prompt ({len(ids)} tokens) + {n} new tokens must fit in S={S}")

    hf = in_child(job_hf, ids, n, threads, None)
    hf_q = in_child(job_hf, ids, n, threads, "int8")
    ts = in_child(job_torch_static, ids, n, S, threads, pad)
    of = in_child(job_ort, dirs["float"], ids, n, threads, pad, keep_logits=True)
    oq = in_child(job_ort, dirs["int8-static"], ids, n, threads, pad, keep_logits=True)
    op = in_child(job_ort, dirs["float"], ids, n, threads, pad, share_weights=False)

    print(f"### Greedy agreement (S={S}, prompt {len(ids)} tokens, {n} new tokens, EOS ignored)\n")
    print("| compared | result |\n|---|---|")
    print(f"| ONNX Runtime float static vs transformers generate | {_div(hf, of, n)} |")
    print(f"| PyTorch static step (eager) vs transformers generate | {_div(hf, ts, n)} |")
    print(f"| ONNX Runtime int8-static vs ONNX Runtime float static | {_div(of, oq, n)} |")
    print(f"| ONNX Runtime int8-static vs kvsqueeze int8 cache (generate) | {_div(hf_q, oq, n)} |")
    print(f"| kvsqueeze int8 cache vs transformers generate (for scale) | {_div(hf, hf_q, n)} |")
    print(f"\nint8-static parameters: per-channel asymmetric uint8, absmax over {prep['calib_tokens']} tokens of "
          f"{prep['calib_source']}; requantizations: {oq['stats']['requantizations']}\n")

    print(f"### Decode speed and memory ({n} tokens, {threads} threads, each path in a fresh process)\n")
    print("| path | decode tokens/s | prefill ms | peak RSS MiB | RSS after MiB | KV buffers bytes |")
    print("|---|---|---|---|---|---|")
    rows = [("transformers generate, DynamicCache fp32", hf, "dynamic"),
            ("kvsqueeze int8 cache, transformers generate", hf_q, "dynamic"),
            ("PyTorch static step (eager), float, manager", ts, ts["kv_bytes"]),
            ("ONNX Runtime static, float (weights mapped once, shared)", of, of["kv_bytes"]),
            ("ONNX Runtime static, int8-static (weights shared)", oq, oq["kv_bytes"]),
            ("ONNX Runtime static, float, private prepacked weights per session", op, op["kv_bytes"])]
    for name, r, kvb in rows:
        print(f"| {name} | {r['tps']:.1f} | {r['prefill_ms']:.0f} | {r['peak_rss_mb']:.0f} | {r['rss_mb']:.0f} | "
              f"{kvb} |")
    print(f"\n(The ONNX Runtime processes import no torch: {not of['torch_loaded']}. Prefill is the fixed "
          f"{S - 1}-token prompt graph. The exact same tokens in every float row: "
          f"{of['tokens'] == op['tokens'] == ts['tokens']}.)\n")

    print(f"### Window copies over {a.long_tokens} generated tokens (S={S}, sliding past S)\n")
    print("| storage | manager | slots per buffer | KV buffers bytes | copies | expected | bytes moved | "
          "copy time ms | decode tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    from kvsqueeze.engines.static_manager import expected_copies

    for kv in ("float", "int8-static"):
        for label, kw in (("reserve 2(S-1)", {"reserve": 2.0}), ("reserve 1.5(S-1)", {"reserve": 1.5}),
                          ("naive shift (S slots)", {"naive": True})):
            r = in_child(job_ort, dirs[kv], ids, a.long_tokens, threads, pad, on_full="slide", **kw)
            st = r["stats"]
            print(f"| {kv} | {label} | {r['reserved']} | {r['kv_bytes']} | {st['copies']} | "
                  f"{expected_copies(r['steps'], S, r['reserved'])} | {st['bytes_moved']} | "
                  f"{st['copy_ns'] / 1e6:.1f} | {r['tps']:.1f} |", flush=True)
    print(f"\n(copies counted over {a.long_tokens - 1} decode steps; staging bytes: 0 in every run, the token-major "
          f"window is bound to ONNX Runtime in place)\n")

    from kvsqueeze.engines.static_manager import static_buffer_bytes

    print("### Shared-buffer formula: 2 x layers x KV heads x reserve(S-1) x D x bits/8\n")
    print("| model | S | reserve | bits | bytes |\n|---|---|---|---|---|")
    for name, geo in (("Llama-7B (32 x 32 x 128)", (32, 32, 128)), ("SmolLM2-135M (30 x 3 x 64)", (30, 3, 64))):
        for s_, reserve, bits in ((2048, 2.0, 16), (2048, 1.5, 16), (S, 2.0, 32), (S, 2.0, 8), (S, 1.5, 8)):
            print(f"| {name} | {s_} | {reserve:g} | {bits} | {static_buffer_bytes(*geo, s_, reserve, bits):,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
