"""The llama.cpp peer: registration through the one resolver, refusals in one line, the bytes computed from ggml's
block layouts, the report's cells, and (where llama-cpp-python is installed) llama.cpp's perplexity on the
embedded GGUF against transformers' on the same token ids, its quantized caches against its own f16 cache, and a
tiny ``kvsqueeze bench`` with llama.cpp rows."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from kvsqueeze import resolve_kv
from kvsqueeze.cli import main
from kvsqueeze.errors import MissingDependencyError, UnknownCacheError, UnsupportedCacheError
from kvsqueeze.eval import engine_peers, report
from kvsqueeze.eval.bench import make_plan, not_measured
from kvsqueeze.eval.llamacpp_peer import LlamaCppPeer, check_protocol, gguf_path, kv_bytes, make_peer
from kvsqueeze.resolve import resolve_cache_spec

LLAMACPP_HERE = importlib.util.find_spec("llama_cpp") is not None
needs_llamacpp = pytest.mark.skipif(not LLAMACPP_HERE, reason="llama-cpp-python is not installed (an optional peer)")
LAYOUT = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}  # the embedded model


@pytest.fixture
def no_llamacpp(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llama_cpp" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_names_resolve_through_the_one_resolver():
    assert make_peer("llamacpp:q4_0") == LlamaCppPeer("q4_0", "q4_0")
    assert make_peer("llamacpp:q8_0-q4_0") == LlamaCppPeer("q8_0", "q4_0")
    assert make_peer("llamacpp:q8_0-q4_0").name == "llamacpp:q8_0-q4_0"
    assert make_peer("llamacpp:f16-f16").name == "llamacpp:f16"  # one spelling per pair
    for bad in ("llamacpp:q3_k", "llamacpp:", "llamacpp:q4_0-q4_0-q4_0", "llamacpp:Q4_0"):
        with pytest.raises(UnknownCacheError, match=r"unknown llama.cpp KV cache type.*llamacpp:q4_0.*q8_0-q4_0"):
            make_peer(bad)
    with pytest.raises(UnsupportedCacheError, match="is a peer"):
        resolve_cache_spec("llamacpp:q4_0")


def test_missing_llamacpp_is_one_line_naming_the_install(no_llamacpp, capsys):
    with pytest.raises(MissingDependencyError, match=r"llama-cpp-python.*pip install llama-cpp-python"):
        resolve_kv("llamacpp:q4_0")
    assert main(["ppl", "--kv", "llamacpp:q4_0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "llama-cpp-python" in err[0]


def test_bits_follow_ggml_blocks():
    # 32 elements per block: an fp16 scale (and an fp16 minimum for the _1 types) beside the codes
    bits = {t: make_peer(f"llamacpp:{t}").bits_per_element() for t in
            ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")}
    assert bits == {"f32": 32, "f16": 16, "bf16": 16, "q8_0": 8.5, "q5_1": 6.0, "q5_0": 5.5, "q4_1": 5.0,
                    "q4_0": 4.5, "iq4_nl": 4.5}
    assert make_peer("llamacpp:q8_0-q4_0").bits_per_element() == 6.5
    assert make_peer("llamacpp:q4_0").quantized and not make_peer("llamacpp:f16").quantized
    assert make_peer("llamacpp:f16-q4_0").quantized


def test_records_say_whether_llamacpp_rotates(monkeypatch):
    monkeypatch.delenv("LLAMA_ATTN_ROT_DISABLE", raising=False)
    assert make_peer("llamacpp:q4_0").settings()["hadamard_rotation"].startswith("llama.cpp's default")
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "1")
    assert make_peer("llamacpp:q4_0").settings()["hadamard_rotation"] == "off (LLAMA_ATTN_ROT_DISABLE)"


def test_kv_bytes_are_computed_from_the_blocks():
    per_side = 1024 * 2 * 30 * 3 * 64  # tokens x batch x layers x KV heads x head_dim
    q = kv_bytes(make_peer("llamacpp:q4_0"), LAYOUT, tokens=1024, batch=2)
    assert (q["codes"], q["params"], q["full_precision"]) == (2 * per_side * 18 // 32, 0, 0)
    assert (q["elements"], q["quantized_elements"]) == (2 * per_side, 2 * per_side)
    assert (q["bits_per_element"], q["quantized_bits_per_element"]) == (4.5, 4.5)
    assert q["bytes_per_token"] == pytest.approx(2 * 30 * 3 * 64 * 4.5 / 8)
    mixed = kv_bytes(make_peer("llamacpp:f16-q4_0"), LAYOUT, tokens=1024)
    half = per_side // 2
    assert (mixed["codes"], mixed["full_precision"], mixed["quantized_elements"]) == (half * 18 // 32, 2 * half, half)
    assert mixed["bits_per_element"] == pytest.approx(10.25) and mixed["quantized_bits_per_element"] == 4.5
    f16 = kv_bytes(make_peer("llamacpp:f16"), LAYOUT, tokens=1024)
    assert (f16["codes"], f16["quantized_bits_per_element"], f16["bits_per_element"]) == (0, None, 16.0)


def test_only_the_all_quantized_protocol_and_gguf_models(tmp_path, capsys):
    peer = make_peer("llamacpp:q4_0")
    check_protocol(peer, "all-quantized")
    for protocol in ("window", "decode"):
        with pytest.raises(UnsupportedCacheError, match="only be measured with --protocol all-quantized"):
            check_protocol(peer, protocol)
    assert gguf_path(None).suffix == ".gguf"  # the embedded model's file
    folder = tmp_path / "hf"
    folder.mkdir()
    with pytest.raises(UnsupportedCacheError, match=r"load a .gguf file.*is not a .gguf file"):
        gguf_path(folder)
    with pytest.raises(UnsupportedCacheError, match="is not a .gguf file"):
        gguf_path(tmp_path / "missing.gguf")
    if LLAMACPP_HERE:
        assert main(["ppl", "--kv", "llamacpp:q4_0", "--protocol", "window"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "all-quantized" in err[0]


def test_engine_peers_dispatch_and_report_against_their_own_reference():
    peer = make_peer("llamacpp:q4_0")
    assert engine_peers.is_engine(peer) and not engine_peers.is_engine(resolve_kv("kivi-4"))
    assert engine_peers.reference_of("llamacpp:q4_0") == "llamacpp:f16"
    assert engine_peers.reference_of("vllm:fp8_e4m3") == "vllm:auto"
    assert engine_peers.reference_of("kivi-4") is None
    assert engine_peers.not_applicable(peer)["retrieval"] == "not run through llama.cpp"
    results = {"ppl": {"all-quantized": {"full": {"ppl": 10.0}, "llamacpp:f16": {"ppl": 10.2},
                                         "llamacpp:q4_0": {"ppl": 10.71}}}, "caches": [{"name": "full"}]}
    cell = report.ppl_cell(results, "all-quantized", "llamacpp:q4_0")
    assert cell.startswith("10.710") and "(+5.00% vs llamacpp:f16)" in cell
    assert "vs llamacpp:f16" not in report.ppl_cell(results, "all-quantized", "llamacpp:f16")


def test_bench_marks_what_llamacpp_cannot_fill():
    if not LLAMACPP_HERE:
        pytest.skip("llama-cpp-python is not installed (an optional peer)")
    plan = make_plan(True, ["kivi-4", "llamacpp:q4_0"])
    out = not_measured(plan, {"llamacpp:q4_0": "boom"})
    assert out["llamacpp:q4_0"]["window"] == "llama.cpp quantizes every token"
    assert out["llamacpp:q4_0"]["speed"] == "its engine failed" and "kivi-4" not in out


@needs_llamacpp
def test_llamacpp_f16_matches_transformers_and_its_quantized_caches_cost_what_their_bits_say(embedded):
    """llama.cpp's f16 cache on the embedded GGUF scores the same token ids as transformers' fp32 model (the same
    Q4_1 weights, llama.cpp's own kernels: within 2% in perplexity), and its quantized caches lose in the order of
    their bits (q8_0 < q4_0)."""
    from kvsqueeze import corpus as corpus_mod
    from kvsqueeze.eval.llamacpp_peer import run_ppl
    from kvsqueeze.eval.ppl import run_ppl as run_ours

    model, tokenizer = embedded
    ids = corpus_mod.tokenize(corpus_mod.resolve_corpus(None, "python-docs"), tokenizer)
    chunks = corpus_mod.eval_chunks(ids, 256, 2)
    vocab = model.get_output_embeddings().weight.shape[0]
    got = {t: run_ppl(make_peer(f"llamacpp:{t}"), chunks, None, 2, layout=LAYOUT, vocab=vocab)
           for t in ("f16", "q8_0", "q4_0")}
    ours = run_ours(model, chunks, "full", "all-quantized", 0)
    assert got["f16"]["ppl"] == pytest.approx(ours["ppl"], rel=0.02)
    assert got["f16"]["tokens_scored"] == ours["tokens_scored"] == 2 * 255
    assert got["f16"]["ppl"] * 0.995 < got["q8_0"]["ppl"] < got["q4_0"]["ppl"]
    assert got["q4_0"]["kv_bytes"]["bits_per_element"] == 4.5 and got["q4_0"]["engine"].startswith("llama.cpp")
    with pytest.raises(UnsupportedCacheError, match="vocabulary"):
        run_ppl(make_peer("llamacpp:f16"), chunks, None, 1, vocab=vocab + 1)


@needs_llamacpp
def test_a_file_llamacpp_cannot_load_is_one_line(tmp_path, capsys):
    from kvsqueeze.eval.llamacpp_peer import run_ppl

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(UnsupportedCacheError, match="llama.cpp could not set up broken.gguf"):
        run_ppl(make_peer("llamacpp:q4_0"), torch.arange(100, 132)[None], bad, 1)


@needs_llamacpp
def test_every_allowed_type_runs_in_llamacpp():
    # each name the peer family accepts reaches llama.cpp as a cache type it takes (the bindings lack some ids)
    from kvsqueeze.eval.llamacpp_peer import TYPES, run_ppl

    chunks = torch.arange(100, 132)[None]
    got = {t: run_ppl(make_peer(f"llamacpp:{t}"), chunks, None, 1)["ppl"] for t in TYPES}
    assert all(torch.isfinite(torch.tensor(v)) for v in got.values())
    assert got["bf16"] != got["f16"] or got["q4_0"] != got["f16"]  # the types really differ in what they store


@needs_llamacpp
def test_ppl_and_speed_commands_print_llamacpp_rows(tmp_path, capsys):
    out = tmp_path / "ppl.json"
    assert main(["ppl", "--kv", "llamacpp:q8_0-q4_0", "--context", "128", "--chunks", "1", "--dataset",
                 "python-docs", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "protocol all-quantized" in text and "6.500 bits/element" in text and "llama.cpp" in text
    record = json.loads(out.read_text())
    assert record["kv"] == "llamacpp:q8_0-q4_0" and record["protocol"] == "all-quantized"
    assert " = 1" in record["llama_cpp_system_info"]  # llama.cpp's own feature report
    assert main(["speed", "--kv", "llamacpp:q4_0", "--context", "64", "--decode-tokens", "4"]) == 0
    text = capsys.readouterr().out
    assert "ms/token (batch 1, llama.cpp" in text and "4.500 bits/element" in text
    assert main(["speed", "--kv", "llamacpp:q4_0", "--context", "64", "--batch", "2"]) == 2
    assert main(["speed", "--kv", "llamacpp:q4_0", "--budget", "1GiB"]) == 2


@needs_llamacpp
def test_bench_with_llamacpp_rows(tmp_path):
    folder_parent = tmp_path / "bench"
    rc = main(["bench", "--quick", "--kv", "full,llamacpp:f16,llamacpp:q4_0", "--dataset", "python-docs",
               "--ppl-context", "128", "--ppl-chunks", "1", "--ppl-decode-tokens", "8", "--lengths", "256",
               "--depths", "0.5", "--speed-contexts", "64", "--decode-tokens", "2", "--out", str(folder_parent),
               "--no-progress"])
    assert rc == 0
    (folder,) = folder_parent.iterdir()
    results = json.loads((folder / "results.json").read_text())
    col = results["ppl"]["all-quantized"]
    assert {"full", "llamacpp:f16", "llamacpp:q4_0"} <= set(col)
    assert results["speed"]["llamacpp:q4_0"]["64"]["decode_ms_per_token"] > 0
    md = (folder / "report.md").read_text()
    assert "vs llamacpp:f16" in md and "`llamacpp:*` rows" in md
    assert torch.isfinite(torch.tensor(col["llamacpp:q4_0"]["ppl"]))


@needs_llamacpp
@pytest.mark.parametrize("kind,block_bytes", [("q8_0", 34), ("q4_0", 18)])
def test_the_formats_benchmark_stores_what_ggml_stores(kind, block_bytes):
    """benchmarks/llamacpp_formats.py's emulation of ggml's q8_0 / q4_0 equals ggml's own reference quantizer
    followed by its dequantizer (from the library llama-cpp-python ships), bit for bit."""
    import ctypes
    import importlib.util as iu
    from pathlib import Path

    import llama_cpp

    root = Path(__file__).resolve().parents[2]
    spec = iu.spec_from_file_location("llamacpp_formats", root / "benchmarks" / "llamacpp_formats.py")
    bench = iu.module_from_spec(spec)
    import sys

    sys.path.insert(0, str(root / "benchmarks"))
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(root / "benchmarks"))
    (lib_path,) = sorted(Path(llama_cpp.__file__).parent.glob("lib/libggml-base.so"))
    lib = ctypes.CDLL(str(lib_path))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=g) * torch.logspace(-3, 2, 64)[:, None]
    x[3] = 0.0  # an all-zero block: scale 0
    x[5, :32] = torch.linspace(-1, 1, 32)
    flat = x.reshape(-1).contiguous()
    n = flat.numel()
    packed = (ctypes.c_uint8 * (n // 32 * block_bytes))()
    out = torch.empty(n)
    fptr = ctypes.cast(flat.data_ptr(), ctypes.POINTER(ctypes.c_float))
    getattr(lib, f"quantize_row_{kind}_ref")(fptr, packed, ctypes.c_int64(n))
    getattr(lib, f"dequantize_row_{kind}")(packed, ctypes.cast(out.data_ptr(), ctypes.POINTER(ctypes.c_float)),
                                           ctypes.c_int64(n))
    assert torch.equal(bench.ggml_roundtrip(x, kind).reshape(-1), out)
