"""kvsqueeze bench end to end on a tiny saved model: every file, in seconds."""

from __future__ import annotations

import json

import pytest

from kvsqueeze.cli import main
from kvsqueeze.eval.report import pareto_front

SIZES = ["--ppl-context", "64", "--ppl-chunks", "1", "--ppl-decode-tokens", "8", "--lengths", "260",
         "--depths", "0,1", "--speed-contexts", "32,64", "--decode-tokens", "2", "--no-progress"]
FILES = {"report.md", "results.json", "ppl_vs_bits.png", "decode_vs_context.png", "memory_vs_context.png",
         "capacity.png", "retrieval.png"}


def test_bench_quick_writes_every_file(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    caches = "full,kivi-2,hf-dynamic,hf-quanto-int4"
    assert main(["bench", "--quick", "--model", str(tiny_model_dir), "--text", str(tiny_corpus), "--kv", caches,
                 "--out", str(tmp_path), *SIZES]) == 0
    out = capsys.readouterr().out
    assert "expected time" in out
    (folder,) = list(tmp_path.iterdir())  # one complete folder, no leftover partial one
    assert {p.name for p in folder.iterdir()} == FILES
    r = json.loads((folder / "results.json").read_text())
    assert [c["name"] for c in r["caches"]] == caches.split(",")
    assert set(r["ppl"]["window"]) == {"full", "kivi-2"} and set(r["ppl"]["decode"]) == set(caches.split(","))
    assert r["ppl"]["window"]["full"]["ppl"] == pytest.approx(r["ppl"]["all-quantized"]["full"]["ppl"])
    assert set(r["speed"]["hf-quanto-int4"]) == {"32", "64"}
    md = (folder / "report.md").read_text()
    for needle in ("Command: `kvsqueeze bench", "Machine:", "Threads: 2", "Date:", "ppl all-quantized",
                   "| `hf-quanto-int4` | peer |", "decode ms/token @64", "of it in attention @64",
                   "![ppl_vs_bits](ppl_vs_bits.png)"):
        assert needle in md
    for name in caches.split(","):  # every cache's decode steps ran through a clocked attention function (CPU)
        run = r["speed"][name]["64"]
        assert 0 < run["decode_attention_ms_per_token"] < run["decode_ms_per_token"]
    assert md.count("\n| `") == 3 * 4  # results, capacity and retrieval tables: one row per cache each
    cap = r["capacity"]
    assert set(cap) == set(caches.split(",")) and "## Capacity in 2 GiB" in md
    # full precision has nothing fixed: the projection's bytes/token is what the speed run's real cache held
    assert cap["full"]["bytes_per_token"] == r["speed"]["full"]["64"]["kv_bytes"]["bytes_per_token"]
    assert cap["kivi-2"]["bytes_per_token"] < cap["full"]["bytes_per_token"] / 6
    assert cap["kivi-2"]["max_batch"] > cap["full"]["max_batch"]
    assert r["config"]["prefill_chunk"] == 512 and r["speed"]["full"]["64"]["prefill_chunk"] == 512


def _offline(monkeypatch, tmp_path):
    """No $KVSQUEEZE_DATA, an empty kvsqueeze cache, a hub that cannot be reached (the one fetch call)."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    from kvsqueeze import corpus

    def offline(repo_id, filename):
        raise LocalEntryNotFoundError("cannot reach the hub")

    monkeypatch.delenv("KVSQUEEZE_DATA", raising=False)
    monkeypatch.setenv("KVSQUEEZE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(corpus, "_hub_download", offline)


def test_bench_offline_measures_perplexity_on_the_corpus_python_ships(tiny_model_dir, tmp_path, monkeypatch,
                                                                       capsys):
    _offline(monkeypatch, tmp_path)
    assert main(["bench", "--quick", "--model", str(tiny_model_dir), "--kv", "full,kivi-2,hf-dynamic",
                 "--out", str(tmp_path / "b"), *SIZES, "--speed-contexts", "32", "--depths", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "corpus python-docs: the Python interpreter's own documentation text" in out
    assert "corpus resolution: --text FILE: not given; $KVSQUEEZE_DATA: not set; local cache: no " in out
    (folder,) = list((tmp_path / "b").iterdir())
    r = json.loads((folder / "results.json").read_text())
    assert set(r["ppl"]["decode"]) == {"full", "kivi-2", "hf-dynamic"} and set(r["ppl"]["window"]) == {"full", "kivi-2"}
    assert r["meta"]["corpus"]["name"] == "python-docs" and r["meta"]["corpus"]["resolution"][-1].startswith(
        "python-docs: pydoc_data.topics")
    md = (folder / "report.md").read_text()
    assert "- Corpus: python-docs (the Python interpreter's own documentation text" in md
    assert "NOT WikiText-2" in md and "perplexity skipped" not in md
    assert "| `kivi-2` | preset |" in md and "| n/a | n/a | n/a |" not in md


def test_bench_without_any_corpus_still_runs_what_needs_no_data(tiny_model_dir, tmp_path, monkeypatch, capsys):
    _offline(monkeypatch, tmp_path)
    monkeypatch.setitem(__import__("sys").modules, "pydoc_data.topics", None)  # a Python stripped of pydoc_data
    assert main(["bench", "--quick", "--model", str(tiny_model_dir), "--kv", "full", "--out", str(tmp_path / "b"),
                 *SIZES, "--speed-contexts", "32", "--depths", "0.5"]) == 0
    assert "perplexity skipped: no corpus: pydoc_data is missing" in capsys.readouterr().out
    (folder,) = list((tmp_path / "b").iterdir())
    r = json.loads((folder / "results.json").read_text())
    assert "ppl" not in r and r["retrieval"] and r["speed"]
    assert "perplexity skipped" in (folder / "report.md").read_text()


def test_bench_refuses_a_named_corpus_it_cannot_have(tmp_path, monkeypatch, capsys):
    _offline(monkeypatch, tmp_path)
    assert main(["bench", "--dataset", "wikitext2", "--kv", "full", "--out", str(tmp_path / "b")]) == 2
    assert "WikiText-2 was not found" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_expected_time_states_the_load():
    from kvsqueeze.eval.bench import expected_time

    idle = expected_time(600.0, {"cpus_available": 2, "other_load": 0.1}, 1)
    assert (idle["busy"], idle["idle_seconds"]) == (False, 600.0) and "nothing else competes" in idle["text"]
    busy = expected_time(600.0, {"cpus_available": 2, "other_load": 5.0}, 1)  # 6 runnable on 2 CPUs: 3x slower
    assert busy["busy"] and busy["idle_seconds"] == pytest.approx(200.0)
    assert busy["text"].startswith("3.3 to 10 min: about 10 min on this machine as it is now (load average 5.0 "
                                   "on 2 CPUs before this run: other programs compete")
    unknown = expected_time(60.0, {"cpus_available": 2, "other_load": None}, 2)
    assert unknown["busy"] is None and "unknown" in unknown["text"]


def test_bench_bad_input_writes_nothing(tmp_path, capsys):
    assert main(["bench", "--kv", "full,bogus", "--out", str(tmp_path / "b")]) == 2
    assert "unknown cache 'bogus'" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_pareto_front():
    pts = [(3.0, 20.0), (4.5, 1.0), (5.0, 5.0), (8.5, 0.1), (32.0, 0.0), (16.0, 0.5)]
    assert pareto_front(pts) == [(3.0, 20.0), (4.5, 1.0), (8.5, 0.1), (32.0, 0.0)]
