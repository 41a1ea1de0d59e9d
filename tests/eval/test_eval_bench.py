"""kvsqueeze bench end to end on a tiny saved model: every file, in seconds."""

from __future__ import annotations

import json

import pytest

from kvsqueeze.cli import main
from kvsqueeze.eval.report import pareto_front

SIZES = ["--ppl-context", "64", "--ppl-chunks", "1", "--ppl-decode-tokens", "8", "--lengths", "260",
         "--depths", "0,1", "--speed-contexts", "32,64", "--decode-tokens", "2", "--no-progress"]
FILES = {"report.md", "results.json", "ppl_vs_bits.png", "decode_vs_context.png", "memory_vs_context.png",
         "retrieval.png"}


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
                   "| `hf-quanto-int4` | peer |", "decode ms/token @64", "![ppl_vs_bits](ppl_vs_bits.png)"):
        assert needle in md
    assert md.count("\n| `") == 2 * 4  # results table and retrieval table: one row per cache each


def test_bench_without_corpus_runs_what_needs_no_data(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVSQUEEZE_DATA", str(tmp_path / "empty"))
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # offline and without the hub client
    assert main(["bench", "--quick", "--model", str(tiny_model_dir), "--kv", "full", "--out", str(tmp_path / "b"),
                 *SIZES, "--speed-contexts", "32", "--depths", "0.5"]) == 0
    assert "KVSQUEEZE_DATA" in capsys.readouterr().out
    (folder,) = list((tmp_path / "b").iterdir())
    r = json.loads((folder / "results.json").read_text())
    assert "ppl" not in r and r["retrieval"] and r["speed"]
    assert "perplexity skipped" in (folder / "report.md").read_text()


def test_bench_bad_input_writes_nothing(tmp_path, capsys):
    assert main(["bench", "--kv", "full,bogus", "--out", str(tmp_path / "b")]) == 2
    assert "unknown cache 'bogus'" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_pareto_front():
    pts = [(3.0, 20.0), (4.5, 1.0), (5.0, 5.0), (8.5, 0.1), (32.0, 0.0), (16.0, 0.5)]
    assert pareto_front(pts) == [(3.0, 20.0), (4.5, 1.0), (8.5, 0.1), (32.0, 0.0)]
