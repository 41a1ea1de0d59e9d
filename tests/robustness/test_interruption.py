"""Real commands killed at chosen points (SIGKILL: nothing runs after; SIGINT: Ctrl-C), then what they left.

The kill points are audit events inside the child (tests/robustness/_child.py), so each kill lands at the same
place on every run: while the staged output is half-written, between a staged output being complete and taking
its place, and just after an existing output was swapped out.  Checked: the target is either absent/old or
complete, never half-written; Ctrl-C is one line and exit code 130; the next run removes what a killed run
staged and writes exactly what an uninterrupted run writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ._plans import (
    ARTIFACT,
    calibrate,
    count,
    export_vllm,
    no_traceback,
    one_line,
    ppl,
    run_plan,
    save_tiny_model,
    staging,
    under,
)

SPEC = "kvsqueeze_artifact.json"


def _kill(event: str, match: str, sig: str = "KILL", nth: int = 1) -> dict:
    return {"event": event, "match": match, "signal": sig, "nth": nth}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("interrupt")
    tiny = save_tiny_model(root / "tiny-model")
    d = {name: root / name for name in ("ref", "cal", "ppl", "exp", "mc")}
    for p in d.values():
        p.mkdir()
    cal, exp, ppl_ = calibrate(tiny), export_vllm(tiny, d["ref"] / ARTIFACT), ppl(tiny)
    steps = [
        # uninterrupted references
        ("ref-calibrate", d["ref"], {"argv": cal}),
        ("ref-ppl", d["ref"], {"argv": ppl_}),
        ("ref-export", d["ref"], {"argv": exp}),
        # calibrate: killed while the staged artifact is half-written (tensors written, document not)
        ("cal-kill-staged", d["cal"], {"argv": cal, "kill_at": _kill("open", SPEC)}),
        ("cal-rerun", d["cal"], {"argv": cal}),
        # Ctrl-C at the same point over an existing artifact
        ("cal-int-staged", d["cal"], {"argv": cal + ["--overwrite"], "kill_at": _kill("open", SPEC, "INT")}),
        # killed after the swap: the new artifact is in place, the old one not yet removed
        ("cal-kill-swapped", d["cal"], {"argv": cal + ["--overwrite"],
                                        "kill_at": _kill("shutil.rmtree", ".tmp-")}),
        ("cal-rerun2", d["cal"], {"argv": cal + ["--overwrite"]}),
        # ppl --json: killed with the report staged but not renamed; Ctrl-C while staging it
        ("ppl-kill-rename", d["ppl"], {"argv": ppl_, "kill_at": _kill("os.rename", "report.json")}),
        ("ppl-int-open", d["ppl"], {"argv": ppl_, "kill_at": _kill("open", ".report.json.tmp-", "INT")}),
        ("ppl-rerun", d["ppl"], {"argv": ppl_}),
        # export --vllm: killed while the checkpoint is staged (config written, weights not)
        ("exp-kill-staged", d["exp"], {"argv": exp, "kill_at": _kill("open", "config.json")}),
        ("exp-int-staged", d["exp"], {"argv": exp,
                                      "kill_at": _kill("open", "export.json", "INT")}),
        ("exp-rerun", d["exp"], {"argv": exp}),
        # the converted-model cache: killed while the entry is staged
        ("mc-kill-staged", d["mc"], {"py": "model_cache", "args": [str(d["mc"] / "cache")],
                                     "kill_at": _kill("open", "config.json")}),
        ("mc-rerun", d["mc"], {"py": "model_cache", "args": [str(d["mc"] / "cache")]}),
        ("mc-again", d["mc"], {"py": "model_cache", "args": [str(d["mc"] / "cache")]}),
    ]
    plan = [{"name": name, "cwd": str(cwd), **step} for name, cwd, step in steps]
    return {**run_plan(plan, root, tiny), "root": root}


def _artifact(files: dict[str, str]) -> dict[str, str]:
    return under(files, ARTIFACT)


def _same_artifact(a: Path, b: Path) -> None:
    """The same tensors, the same quantization document (the run's command line and timings aside)."""
    da, db = (json.loads((p / ARTIFACT / SPEC).read_text()) for p in (a, b))
    for key in ("layers", "settings", "tensor_shapes", "method", "model", "rope"):
        assert da[key] == db[key], key
    assert (a / ARTIFACT / "tensors.safetensors").read_bytes() == (b / ARTIFACT / "tensors.safetensors").read_bytes()


def test_references_ran(runs: dict[str, dict]) -> None:
    for name in ("ref-calibrate", "ref-ppl", "ref-export"):
        no_traceback(runs[name])
        assert runs[name]["rc"] == 0, runs[name]["stderr"][-2000:]


def test_calibrate_killed_while_staged(runs: dict[str, dict]) -> None:
    killed, rerun = runs["cal-kill-staged"], runs["cal-rerun"]
    assert killed["rc"] == -9
    assert not _artifact(killed["files"]) and ARTIFACT not in killed["files"]  # no half-written artifact
    assert len(staging(killed["files"])) == 1  # what SIGKILL leaves: the staging folder
    assert rerun["rc"] == 0 and not staging(rerun["files"])  # the next run removed it
    assert _artifact(rerun["files"])[SPEC] and _artifact(rerun["files"])["tensors.safetensors"]
    _same_artifact(runs["root"] / "ref", runs["root"] / "cal")
    count("calibrate, SIGKILL while the artifact is staged", "no artifact; rerun cleans and matches")


def test_calibrate_ctrl_c_keeps_the_old_artifact(runs: dict[str, dict]) -> None:
    r = runs["cal-int-staged"]
    one_line(r, 130, "calibrate", "interrupted")
    assert not staging(r["files"])  # Ctrl-C cleans up at once
    assert _artifact(r["files"]) == _artifact(runs["cal-rerun"]["files"])  # the old artifact, unchanged
    count("calibrate --overwrite, Ctrl-C while the new artifact is staged", "exit 130, old artifact intact")


def test_calibrate_killed_after_swap(runs: dict[str, dict]) -> None:
    killed, rerun = runs["cal-kill-swapped"], runs["cal-rerun2"]
    assert killed["rc"] == -9
    art = _artifact(killed["files"])
    assert set(art) == {SPEC, "tensors.safetensors"}  # complete: the swap is one rename
    left = staging(killed["files"])
    assert left and all(".tmp-" in f for f in left)  # the old artifact, swapped out, not yet removed
    assert rerun["rc"] == 0 and not staging(rerun["files"])
    tensors = "tensors.safetensors"
    assert _artifact(rerun["files"])[tensors] == _artifact(runs["cal-rerun"]["files"])[tensors]
    _same_artifact(runs["root"] / "ref", runs["root"] / "cal")
    count("calibrate --overwrite, SIGKILL just after the swap", "artifact complete; rerun cleans")


def test_ppl_json_killed_and_interrupted(runs: dict[str, dict]) -> None:
    killed, ctrl_c, rerun, ref = (runs[n] for n in ("ppl-kill-rename", "ppl-int-open", "ppl-rerun", "ref-ppl"))
    assert killed["rc"] == -9 and "report.json" not in killed["files"]
    assert len(staging(killed["files"])) == 1  # the complete report, staged, never renamed
    one_line(ctrl_c, 130, "ppl", "interrupted")
    assert "report.json" not in ctrl_c["files"]
    assert not staging(ctrl_c["files"])  # Ctrl-C removes its own staging, and the killed run's is gone too
    assert rerun["rc"] == 0 and not staging(rerun["files"]) and "report.json" in rerun["files"]
    got, want = (json.loads((runs["root"] / d / "report.json").read_text()) for d in ("ppl", "ref"))
    assert got["ppl"] == want["ppl"] and got["ppl_per_chunk"] == want["ppl_per_chunk"]
    count("ppl --json, SIGKILL between staging and rename", "no report; rerun cleans and matches")
    count("ppl --json, Ctrl-C while the report is staged", "exit 130, no report, no staging")


def test_export_vllm_killed_and_interrupted(runs: dict[str, dict]) -> None:
    killed, ctrl_c, rerun = runs["exp-kill-staged"], runs["exp-int-staged"], runs["exp-rerun"]
    assert killed["rc"] == -9 and "out" not in killed["files"] and len(staging(killed["files"])) == 1
    one_line(ctrl_c, 130, "export", "interrupted")
    assert "out" not in ctrl_c["files"] and not staging(ctrl_c["files"])
    assert rerun["rc"] == 0 and not staging(rerun["files"])
    got, want = under(rerun["files"], "out"), under(runs["ref-export"]["files"], "out")
    assert set(got) == set(want) and {k: got[k] for k in got if k != "export.json"} == \
        {k: want[k] for k in want if k != "export.json"}
    count("export --vllm, SIGKILL while the checkpoint is staged", "no checkpoint; rerun cleans and matches")
    count("export --vllm, Ctrl-C while the record is written", "exit 130, no checkpoint, no staging")


def test_model_cache_killed_while_staged(runs: dict[str, dict]) -> None:
    killed, rerun, again = runs["mc-kill-staged"], runs["mc-rerun"], runs["mc-again"]
    assert killed["rc"] == -9
    entries = under(killed["files"], "cache")
    assert len(staging(entries)) == 1 and not any("config.json" in k and not staging([k.split("/")[0]])
                                                  for k in entries)
    for r in (rerun, again):
        no_traceback(r)
        assert r["rc"] == 0 and not staging(r["files"])
    assert rerun["stdout"] == again["stdout"]  # the cached entry gives the converted model's logits
    assert sum(1 for k, v in under(again["files"], "cache").items() if "/" not in k and v == "dir") == 1
    count("model cache, SIGKILL while the converted model is staged", "no entry; next load cleans and caches")
