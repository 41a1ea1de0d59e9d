"""kvsqueeze frontier on a tiny saved model: the measurements come from the bench's stages; the per-budget
choice, the table, the JSON and the plot are checked here."""

from __future__ import annotations

import json

from kvsqueeze.cli import main
from kvsqueeze.eval.frontier import best_at, frontier_rows


def _res(ppl_bits: dict[str, tuple[float, float]], kinds: dict[str, str]) -> dict:
    col = {n: {"ppl": p, "quantized_bits_per_element": b} for n, (p, b) in ppl_bits.items()}
    return {"caches": [{"name": n, "kind": k} for n, k in kinds.items()], "ppl": {"decode": col}}


def test_best_at_respects_the_budget_and_kind():
    res = _res({"full": (10.0, 16.0), "a": (10.5, 3.0), "b": (10.2, 3.25), "c": (12.0, 2.0), "p": (11.0, 2.5)},
               {"full": "preset", "a": "preset", "b": "preset", "c": "preset", "p": "peer"})
    kinds = {c["name"]: c["kind"] for c in res["caches"]}
    col = res["ppl"]["decode"]
    assert best_at(col, 3.0, kinds, "preset")[0] == "a"  # b is over budget, full never counts
    assert best_at(col, 3.25, kinds, "preset")[0] == "b"
    assert best_at(col, 1.9, kinds, "preset") is None
    assert best_at(col, 3.0, kinds, "peer")[0] == "p"
    rows = frontier_rows(res, (2.0, 2.5, 3.0))
    assert [r["decode"]["kvsqueeze"]["kv"] for r in rows] == ["c", "c", "a"]
    assert [r["decode"]["kvsqueeze_ahead"] for r in rows] == [None, False, True]
    assert abs(rows[2]["decode"]["kvsqueeze"]["delta_percent"] - 5.0) < 1e-9


def test_engine_peers_are_read_against_their_own_unquantized_cache():
    # llama.cpp runs the GGUF's own weights and kernels: its q4_0 row is read against llamacpp:f16, not `full`
    col = {"full": {"ppl": 10.0, "quantized_bits_per_element": None},
           "kivi-4": {"ppl": 10.3, "quantized_bits_per_element": 5.0},
           "llamacpp:f16": {"ppl": 10.2, "quantized_bits_per_element": None},
           "llamacpp:q4_0": {"ppl": 10.4, "quantized_bits_per_element": 4.5},
           "llamacpp:q4_1": {"ppl": 10.45, "quantized_bits_per_element": 5.0},
           "vllm:auto": {"ppl": 9.0, "quantized_bits_per_element": None},
           "vllm:fp8_e4m3": {"ppl": 9.05, "quantized_bits_per_element": 8.0}}
    kinds = {"full": "preset", "kivi-4": "preset"} | {n: "peer" for n in col if ":" in n}
    res = {"caches": [{"name": n, "kind": k} for n, k in kinds.items()], "ppl": {"all-quantized": col}}
    (row,) = frontier_rows(res, (5.0,))
    peer, ours = row["all-quantized"]["peer"], row["all-quantized"]["kvsqueeze"]
    assert peer["kv"] == "llamacpp:q4_0" and peer["against"] == "llamacpp:f16"  # +1.96% beats q4_1's +2.45%
    assert abs(peer["delta_percent"] - 100 * (10.4 / 10.2 - 1)) < 1e-9
    assert ours["kv"] == "kivi-4" and ours["against"] is None and abs(ours["delta_percent"] - 3.0) < 1e-9
    assert row["all-quantized"]["kvsqueeze_ahead"] is False  # lower ppl (10.3 < 10.4), but the larger change
    (row8,) = frontier_rows(res, (8.0,))
    assert row8["all-quantized"]["peer"]["kv"] == "vllm:fp8_e4m3"  # +0.56% vs vllm:auto
    from kvsqueeze.eval.frontier import markdown

    table = markdown([row], {**res, "ppl": res["ppl"]})
    assert "`llamacpp:q4_0` 4.500 b: 10.400 (+1.96% vs llamacpp:f16) | no |" in table


def test_frontier_command_end_to_end(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    out = tmp_path / "f"
    assert main(["frontier", "--model", str(tiny_model_dir), "--text", str(tiny_corpus), "--kv", "kivi-2,int4",
                 "--peers", "hf-quanto-int4,vllm:fp8_e4m3", "--budgets", "3,5", "--context", "300", "--chunks",
                 "1", "--decode-tokens", "8", "--threads", "1", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "| budget (bits) |" in printed
    assert {p.name for p in out.iterdir()} == {"frontier.md", "frontier.json", "frontier.png"}
    res = json.loads((out / "frontier.json").read_text())
    rows = {r["budget"]: r for r in res["frontier"]}
    assert rows[3.0]["window"]["kvsqueeze"]["kv"] == "kivi-2"  # int4 is 4.5 bits: over the 3-bit budget
    assert rows[5.0]["window"]["kvsqueeze"]["kv"] in {"kivi-2", "int4"}
    assert rows[5.0]["decode"]["peer"]["kv"] == "hf-quanto-int4"
    assert set(res["ppl"]["window"]) == {"full", "kivi-2", "int4"}
    # vLLM is not installed on every machine: where it is not, a skip note instead of a failure
    names = {c["name"] for c in res["caches"]}
    assert "vllm:fp8_e4m3" in names or any(s.startswith("vllm:fp8_e4m3") for s in res["skipped"])


def test_frontier_add_to_measures_only_the_new_cache(tiny_model_dir, tiny_corpus, tmp_path, capsys, monkeypatch):
    out = tmp_path / "f"
    common = ["frontier", "--model", str(tiny_model_dir), "--text", str(tiny_corpus), "--peers", "hf-quanto-int2",
              "--budgets", "3,4", "--context", "200", "--chunks", "1", "--decode-tokens", "4", "--threads", "1",
              "--out", str(out), "--no-progress"]
    assert main([*common, "--kv", "kivi-2"]) == 0
    first = json.loads((out / "frontier.json").read_text())
    assert main([*common, "--kv", "kivi-2,kivi-3", "--add-to"]) == 0
    res = json.loads((out / "frontier.json").read_text())
    assert res["ppl"]["window"]["kivi-2"] == first["ppl"]["window"]["kivi-2"]  # kept, not re-measured
    assert set(res["ppl"]["window"]) == {"full", "kivi-2", "kivi-3"}
    assert [c["name"] for c in res["caches"]] == ["full", "kivi-2", "hf-quanto-int2", "kivi-3"]
    assert {r["budget"]: r["window"]["kvsqueeze"]["kv"] for r in res["frontier"]}[3.0] == "kivi-2"
    # a cache the earlier run measured is kept even where it could not run now (say vLLM is not set up here)
    res["caches"].append({"name": "vllm:fp8_e4m3", "kind": "peer"})
    res["ppl"]["all-quantized"]["vllm:fp8_e4m3"] = {"ppl": 9.9, "quantized_bits_per_element": 8.0}
    (out / "frontier.json").write_text(json.dumps(res))
    monkeypatch.delenv("KVSQUEEZE_VLLM_PYTHON", raising=False)
    assert main([*common, "--kv", "kivi-2,kivi-3", "--peers", "hf-quanto-int2,vllm:fp8_e4m3", "--add-to"]) == 0
    res = json.loads((out / "frontier.json").read_text())
    assert res["ppl"]["all-quantized"]["vllm:fp8_e4m3"]["ppl"] == 9.9
    assert not any(s.startswith("vllm:fp8_e4m3") for s in res["skipped"])
    capsys.readouterr()
    other = [("100" if a == "200" else a) for a in common]  # another context: other chunks
    assert main([*other, "--kv", "kivi-3", "--add-to"]) == 2  # refused in one line
    assert "--add-to" in capsys.readouterr().err


def test_ppl_vs_bits_panels_are_titled_by_protocol(tmp_path, monkeypatch):
    # each panel says which protocol it shows, whatever the caches plotted in it are called
    from kvsqueeze.eval import report

    col = {"full": {"ppl": 10.0, "kv_bytes": {"bits_per_element": 32.0}},
           "arts/auto3.0": {"ppl": 10.4, "kv_bytes": {"bits_per_element": 3.0}},
           "quanto": {"ppl": 11.0, "kv_bytes": {"bits_per_element": 5.0}}}
    res = {"caches": [{"name": "full", "kind": "preset"}, {"name": "arts/auto3.0", "kind": "preset"},
                      {"name": "quanto", "kind": "peer"}],
           "ppl": {"decode": col, "window": dict(col), "all-quantized": dict(col)}}
    titles = []
    monkeypatch.setattr(report, "_savefig", lambda fig, path: titles.extend(a.get_title() for a in fig.axes))
    assert report.plot_ppl_vs_bits(res, tmp_path / "p.png") == tmp_path / "p.png"
    assert titles == ["decode protocol (all caches)", "window protocol (kvsqueeze)",
                      "all-quantized protocol (kvsqueeze, vLLM, llama.cpp)"]
