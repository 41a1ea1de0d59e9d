"""kvsqueeze ppl / speed / retrieval / presets through the CLI: JSON records and bad input."""

from __future__ import annotations

import hashlib
import json

import pytest

from kvsqueeze.cli import main
from kvsqueeze.eval import peers
from kvsqueeze.eval import retrieval as R

PPL_KEYS = {"ppl", "tokens_scored", "protocol", "protocol_note", "context", "chunks", "prefix", "scored_positions",
            "bits_per_element", "quantized_bits_per_element", "kv_bytes", "kv_bytes_per_token", "spec", "model",
            "corpus", "wall_seconds", "threads", "command", "date", "machine"}
KV_BYTES_KEYS = {"codes", "params", "full_precision", "total", "elements", "bits_per_element", "bytes_per_token"}


def _ppl(model_dir, corpus, *extra):
    return ["ppl", "--model", str(model_dir), "--text", str(corpus), "--context", "128", "--chunks", "2", *extra]


def test_ppl_json_record(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    out = tmp_path / "ppl.json"
    assert main(_ppl(tiny_model_dir, tiny_corpus, "--kv", "kivi-2", "--json", str(out))) == 0
    r = json.loads(out.read_text())
    assert PPL_KEYS <= r.keys() and KV_BYTES_KEYS <= r["kv_bytes"].keys()
    assert r["protocol"] == "window" and r["tokens_scored"] == 2 * 127 and r["ppl"] > 1
    assert r["corpus"]["sha256"] == hashlib.sha256(tiny_corpus.read_bytes()).hexdigest()
    assert r["corpus"]["resolution"] == [f"--text FILE: {tiny_corpus}"] and r["corpus"]["name"] == "corpus.txt"
    assert r["spec"]["window"] == 128 and r["spec"]["key"]["axis"] == "channel"
    assert r["bits_per_element"] == pytest.approx(8 * r["kv_bytes"]["total"] / r["kv_bytes"]["elements"])
    assert r["threads"] == 2 and r["model"]["num_kv_heads"] == 1
    assert "ppl" in capsys.readouterr().out


def test_ppl_decode_for_a_peer(tiny_model_dir, tiny_corpus, tmp_path):
    out = tmp_path / "peer.json"
    assert main(_ppl(tiny_model_dir, tiny_corpus, "--kv", "hf-quanto-int4", "--json", str(out))) == 0
    r = json.loads(out.read_text())  # a peer's protocol defaults to decode, half the chunk prefilled
    assert r["kind"] == "peer" and r["protocol"] == "decode" and r["prefix"] == 64 and r["tokens_scored"] == 2 * 64
    assert r["spec"]["backend"] == "quanto" and r["kv_bytes"]["codes"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--kv", "nope"], "unknown cache 'nope'"),
    (["--kv", "hf-dynamic", "--protocol", "window"], "only be measured with --protocol decode"),
    (["--kv", "full", "--context", "5000"], "larger than the model supports"),
    (["--kv", "full", "--chunks", "60"], "corpus too short"),
])
def test_ppl_bad_input_is_one_line_and_no_json(tiny_model_dir, tiny_corpus, tmp_path, capsys, argv, message):
    out = tmp_path / "bad.json"
    argv = ["ppl", "--model", str(tiny_model_dir), "--text", str(tiny_corpus), *argv, "--json", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not out.exists() and not list(tmp_path.iterdir())


def test_missing_peer_library_exits_2_before_loading(monkeypatch, capsys):
    monkeypatch.setattr(peers, "_importable", lambda module: False)
    assert main(["speed", "--kv", "hf-quanto-int2", "--model", "/nonexistent"]) == 2
    assert "pip install" in capsys.readouterr().err


def test_speed_json(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "speed.json"
    assert main(["speed", "--kv", "int4", "--model", str(tiny_model_dir), "--context", "96", "--decode-tokens", "3",
                 "--batch", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["prefill_s"] > 0 and r["decode_ms_per_token"] > 0 and len(r["decode_ms_steps"]) == 3
    assert r["peak_rss_bytes"] >= r["rss_before_bytes"] > 0 and r["threads"] == 2
    assert r["kv_bytes"]["tokens"] == 99 and r["kv_bytes"]["batch"] == 2
    # every step ran its layers' attention, inside the step's own time
    assert 0 < r["decode_attention_ms_per_token"] < r["decode_ms_per_token"]
    printed = capsys.readouterr().out
    assert "2 threads" in printed and "ms in attention" in printed


def test_speed_budget_and_prefill_chunk(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "speed.json"
    assert main(["speed", "--kv", "kivi-2", "--model", str(tiny_model_dir), "--context", "300", "--decode-tokens", "2",
                 "--prefill-chunk", "128", "--budget", "1GiB", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    c = r["capacity"]
    assert r["prefill_chunk"] == 128 and c["budget_bytes"] == 2**30
    per_seq = c["transient_bytes_per_sequence"] + c["fixed_bytes"] + 4096 * c["bytes_per_token"]
    assert c["max_batch"] == int(2**30 // per_seq) and c["bytes_per_sequence"] == pytest.approx(per_seq)
    assert "capacity in 1.00 GiB" in capsys.readouterr().out


def test_speed_budget_projects_a_batch_at_the_context_asked(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "speed.json"
    assert main(["speed", "--kv", "kivi-2", "--model", str(tiny_model_dir), "--context", "300", "--decode-tokens", "2",
                 "--budget", "1GiB", "--batch-context", "2048", "--json", str(out)]) == 0
    c = json.loads(out.read_text())["capacity"]
    per_seq = c["transient_bytes_per_sequence"] + c["fixed_bytes"] + 2048 * c["bytes_per_token"]
    assert c["batch_context"] == 2048 and c["max_batch"] == int(2**30 // per_seq)
    assert "sequences of 2048 tokens" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--budget", "0"], "the memory budget must be positive"),
    (["--budget", "lots"], "cannot read the memory budget 'lots'"),
    (["--prefill-chunk", "-1"], "must be 0 (one pass) or a positive number of tokens"),
    (["--prefill-chunk", "100000"], "larger than the model's context"),
    (["--batch-context", "2048"], "--batch-context takes a positive number of tokens, with --budget"),
    (["--budget", "1GiB", "--batch-context", "0"], "--batch-context takes a positive number of tokens"),
])
def test_speed_bad_budget_or_chunk_is_one_line(tiny_model_dir, capsys, argv, message):
    try:
        code = main(["speed", "--kv", "kivi-2", "--model", str(tiny_model_dir), "--context", "64", *argv])
    except SystemExit as exc:  # argparse's own type errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_retrieval_json_and_heatmap(tiny_model_dir, tmp_path):
    out = tmp_path / "ret.json"
    assert main(["retrieval", "--kv", "hf-dynamic", "--model", str(tiny_model_dir), "--lengths", "260,300",
                 "--depths", "0,1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert len(r["accuracy"]) == 2 and len(r["accuracy"][0]) == 2 and len(r["cells"]) == 4
    assert all(c["prompt_tokens"] <= c["length"] and len(c["passkey"]) == 5 for c in r["cells"])
    assert (tmp_path / "ret.png").stat().st_size > 1000
    hay = r["haystack_source"]  # no corpus is read for the default haystack, and the record says so
    assert hay["name"] == "generated" and hay["source"] == "kvsqueeze.eval.retrieval.FILLER"
    assert hay["sha256"] == hashlib.sha256("\n".join(R.FILLER).encode("utf-8")).hexdigest()


def test_presets_lists_peers(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "kivi-2" in out and "hf-quanto-int4" in out and "hf-dynamic" in out


# ------------------------------------------------------------------------------------------------ --kv everywhere
@pytest.fixture(scope="module")
def calibrated_out(tiny_model_dir, tiny_corpus, tmp_path_factory):
    """`kvsqueeze calibrate --out DIR` on the tiny model: DIR holds one artifact in a named sub-folder."""
    out = tmp_path_factory.mktemp("calibrated")
    assert main(["calibrate", "--method", "skvq", "--model", str(tiny_model_dir), "--text", str(tiny_corpus),
                 "--samples", "2", "--length", "64", "--window", "32", "--out", str(out), "--quiet"]) == 0
    (art,) = [p for p in out.iterdir() if not p.name.startswith(".")]
    return out, art


def test_ppl_right_after_calibrate_out_dir(tiny_model_dir, tiny_corpus, calibrated_out, tmp_path, capsys):
    out, art = calibrated_out
    records = []
    for kv in (out, art):  # the folder calibrate wrote into, and the artifact inside it
        path = tmp_path / f"{kv.name}.json"
        assert main(_ppl(tiny_model_dir, tiny_corpus, "--kv", str(kv), "--json", str(path))) == 0
        records.append(json.loads(path.read_text()))
    a, b = records
    assert a["ppl"] == b["ppl"] and a["kv_bytes"] == b["kv_bytes"]  # the same artifact, the same numbers
    assert a["spec"]["name"] == art.name and a["spec"]["calibrated_layers"] == 2 and a["spec"]["window"] == 32
    assert a["kv_bytes"]["params"] > 0 and a["bits_per_element"] < 32
    capsys.readouterr()


def test_generate_with_an_artifact_and_its_folder(tiny_model_dir, calibrated_out, capsys):
    out, art = calibrated_out
    reports = []
    for kv in (art, out):
        assert main(["generate", "--prompt", "The quick brown fox " * 10, "--raw", "--kv", str(kv), "--model",
                     str(tiny_model_dir), "--max-new-tokens", "4"]) == 0
        reports.append(capsys.readouterr().out.splitlines()[-1])
    # 200 prompt bytes + 3 generated tokens stored; the artifact's K2/ternary storage, not a preset's
    assert reports[0] == reports[1] and reports[0].startswith(f"[{art.name}] 203 tokens: ")
    assert "quantized part 2.312 bits/element" in reports[0] and reports[0].endswith("threads 2")


def test_a_folder_with_two_artifacts_is_refused_in_one_line(tiny_model_dir, tiny_corpus, calibrated_out, tmp_path,
                                                             capsys):
    import shutil

    out, art = calibrated_out
    two = tmp_path / "two"
    shutil.copytree(art, two / "a")
    shutil.copytree(art, two / "b")
    assert main(_ppl(tiny_model_dir, tiny_corpus, "--kv", str(two))) == 2
    assert capsys.readouterr().err == (f"kvsqueeze ppl: error: {two} holds 2 calibration artifacts; name one of "
                                       f"them: {two / 'a'}, {two / 'b'}\n")


def test_generate_refuses_a_peer_and_an_unknown_cache_before_loading(capsys):
    assert main(["generate", "--prompt", "hi", "--kv", "hf-dynamic", "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvsqueeze generate: error: 'hf-dynamic' is a peer (another library's cache") and \
        "kvsqueeze generate builds kvsqueeze's own caches only" in err and err.count("\n") == 1
    assert main(["generate", "--prompt", "hi", "--kv", "nope", "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvsqueeze generate: error: unknown cache 'nope'") and "hf-quanto-int4" in err
    assert err.count("\n") == 1


def test_export_needs_an_artifact(capsys, tmp_path):
    assert main(["export", "--kv", "kivi-2", "--folded", str(tmp_path / "f")]) == 2
    assert capsys.readouterr().err == ("kvsqueeze export: error: --kv must be a calibration artifact directory "
                                       "(kvsqueeze calibrate --method invertible), got 'kivi-2'\n")


def test_ppl_json_to_stdout(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    file_json = tmp_path / "ppl.json"
    assert main(_ppl(tiny_model_dir, tiny_corpus, "--kv", "int4", "--json", str(file_json))) == 0
    capsys.readouterr()
    assert main(_ppl(tiny_model_dir, tiny_corpus, "--kv", "int4", "--json", "-")) == 0
    captured = capsys.readouterr()
    r, f = json.loads(captured.out), json.loads(file_json.read_text())  # stdout holds the document alone
    assert r["ppl"] == f["ppl"] and r["kv_bytes"] == f["kv_bytes"] and r["command"].endswith("--json -")
    assert captured.err.startswith("kvsqueeze ppl: int4, protocol window") and "\nppl " in captured.err
    assert "wrote" not in captured.err + captured.out and not list(tmp_path.glob("*.tmp"))


def test_retrieval_json_to_stdout_draws_no_default_heatmap(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["retrieval", "--kv", "hf-dynamic", "--model", str(tiny_model_dir), "--lengths", "260",
                 "--depths", "0", "--json", "-"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["heatmap_png"] is None and len(r["cells"]) == 1 and list(tmp_path.iterdir()) == []
