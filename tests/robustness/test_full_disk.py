"""Every writer on a full disk: a child process under a file-size limit (RLIMIT_FSIZE with SIGXFSZ ignored, so
a write past it fails with EFBIG as on a full disk), or a read-only folder (skipped as root, where chmod does
not stop writes).  Checked: one ``kvsqueeze <command>: error:`` line and exit code 2, no partial output and no
staging left, what was there before unchanged; a cache that cannot be written (corpus, converted model) costs one
warning line and the run goes on with the same result."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from kvsqueeze import corpus
from kvsqueeze.atomic_dir import clean_stale, disk_error, staged_directory, staging_path
from kvsqueeze.errors import DiskWriteError

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

LIMIT = 4096  # below the artifact's and the checkpoint's files, above nothing else a run writes


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("fulldisk")
    tiny = save_tiny_model(root / "tiny-model")
    d = {n: root / n for n in ("cal", "cal-new", "exp", "exp-new", "ppl", "mc", "small")}
    for p in d.values():
        p.mkdir()
    hub = _fake_hub(root / "hub")
    cache = root / "kvcache"
    (cache / "data").mkdir(parents=True)
    fetch = {"KVSQUEEZE_DATA": "", "KVSQUEEZE_CACHE": str(cache)}
    cal, exp, ppl_ = calibrate(tiny), export_vllm(tiny, d["cal"] / ARTIFACT), ppl(tiny)
    mc_args = [str(d["mc"] / "cache")]
    steps = [
        ("setup-cal", d["cal"], {"argv": cal}),
        ("setup-exp", d["exp"], {"argv": exp}),
        ("cal-new", d["cal-new"], {"argv": cal, "fsize": LIMIT}),
        ("cal-over", d["cal"], {"argv": cal + ["--overwrite"], "fsize": LIMIT}),
        ("exp-new", d["exp-new"], {"argv": exp, "fsize": LIMIT}),
        ("exp-over", d["exp"], {"argv": exp + ["--overwrite"], "fsize": LIMIT}),
        ("ppl-new", d["ppl"], {"argv": ppl_, "fsize": 1024}),
        # the corpus is fetched (from a local hub cache): caching it fails, the run goes on
        ("corpus-full", d["ppl"], {"argv": ppl_, "fsize": 256 * 1024, "env": fetch}),
        ("ppl-over", d["ppl"], {"argv": ppl_, "fsize": 1024}),
        ("corpus-ok", d["ppl"], {"argv": ppl_[:-1] + ["report2.json"], "env": fetch}),
        ("mc-full", d["mc"], {"py": "model_cache", "args": mc_args, "fsize": 4096}),
        ("mc-ok", d["mc"], {"py": "model_cache", "args": mc_args}),
        ("static-full", d["small"], {"py": "static_save", "args": ["scales.npz"], "fsize": 1024}),
        ("plot-full", d["small"], {"py": "plot", "args": ["plot.png"], "fsize": 1024}),
    ]
    if os.geteuid() != 0:  # root writes through chmod
        ro = root / "read-only"
        ro.mkdir(mode=0o555)
        steps.append(("cal-read-only", ro, {"argv": cal}))
    plan = [{"name": name, "cwd": str(cwd), **step} for name, cwd, step in steps]
    # HF_HUB_CACHE is read when huggingface_hub is imported: it is set for the driver, not per step
    return {**run_plan(plan, root, tiny, {"HF_HUB_CACHE": str(hub)}), "root": root, "cache": cache}


def _fake_hub(hub: Path) -> Path:
    """A Hugging Face cache holding WikiText-2's original archive (built from $KVSQUEEZE_DATA's file), so the
    fetch path runs offline: download (from the cache), extraction, SHA-256 check, then the write under test."""
    raw = corpus.wikitext2_path()
    if raw is None:
        pytest.skip("needs WikiText-2 in $KVSQUEEZE_DATA")
    repo, commit = hub / "datasets--ggml-org--ci", "0" * 40
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    with zipfile.ZipFile(snap / "wikitext-2-raw-v1.zip", "w") as z:
        z.writestr("wikitext-2-raw/wiki.test.raw", raw.read_bytes().replace(b"\r\n", b"\n"))
    return hub


def _no_output(r: dict, *names: str) -> None:
    assert not staging(r["files"]), staging(r["files"])
    for n in names:
        assert n not in r["files"] and not under(r["files"], n), n


def test_setup_ran(runs: dict) -> None:
    for name in ("setup-cal", "setup-exp"):
        no_traceback(runs[name])
        assert runs[name]["rc"] == 0, runs[name]["stderr"][-2000:]


def test_calibrate_on_a_full_disk(runs: dict) -> None:
    one_line(runs["cal-new"], 2, "calibrate: error: cannot write", "File too large", "EFBIG")
    _no_output(runs["cal-new"], ARTIFACT)
    count("calibrate, new artifact, disk full", "one line, exit 2, nothing written")
    r = runs["cal-over"]
    one_line(r, 2, "calibrate: error:", "EFBIG", "unchanged")
    assert not staging(r["files"])
    assert under(r["files"], ARTIFACT) == under(runs["setup-cal"]["files"], ARTIFACT)  # the old one, byte for byte
    count("calibrate --overwrite, disk full", "one line, exit 2, old artifact intact")


def test_export_vllm_on_a_full_disk(runs: dict) -> None:
    one_line(runs["exp-new"], 2, "export: error: cannot write", "EFBIG")
    _no_output(runs["exp-new"], "out")
    count("export --vllm, new checkpoint, disk full", "one line, exit 2, nothing written")
    r, old = runs["exp-over"], runs["setup-exp"]
    one_line(r, 2, "export: error:", "EFBIG")
    assert not staging(r["files"]) and under(r["files"], "out") == under(old["files"], "out")
    count("export --vllm --overwrite, disk full", "one line, exit 2, old checkpoint intact")


def test_ppl_json_on_a_full_disk(runs: dict) -> None:
    one_line(runs["ppl-new"], 2, "ppl: error: cannot write", "report.json", "EFBIG")
    _no_output(runs["ppl-new"], "report.json")
    count("ppl --json, new report, disk full", "one line, exit 2, nothing written")
    r, old = runs["ppl-over"], runs["corpus-full"]
    one_line(r, 2, "ppl: error:", "EFBIG")
    assert not staging(r["files"]) and r["files"]["report.json"] == old["files"]["report.json"]
    count("ppl --json over an existing report, disk full", "one line, exit 2, old report intact")


def test_corpus_cache_on_a_full_disk(runs: dict) -> None:
    full, ok = runs["corpus-full"], runs["corpus-ok"]
    one_line(full, 0, "warning: corpus not cached", "EFBIG")  # the run went on
    cached = runs["cache"] / "data" / "wikitext-2-raw" / "wiki.test.raw"
    assert full["rc"] == 0 and "report.json" in full["files"]
    no_traceback(ok)
    assert ok["rc"] == 0 and "warning" not in ok["stderr"]
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == corpus.WIKITEXT2_SHA256  # cached the next time
    assert not [p for p in cached.parent.iterdir() if p.name.startswith(".")]
    got, want = (json.loads((runs["root"] / "ppl" / n).read_text()) for n in ("report.json", "report2.json"))
    assert got["ppl_per_chunk"] == want["ppl_per_chunk"] and got["corpus"]["sha256"] == want["corpus"]["sha256"]
    count("corpus cache (fetched WikiText-2), disk full", "one warning, same result, cached next run")


def test_model_cache_on_a_full_disk(runs: dict) -> None:
    full, ok = runs["mc-full"], runs["mc-ok"]
    one_line(full, 0, "warning: converted model not cached", "EFBIG")
    assert not under(full["files"], "cache") or not [k for k in under(full["files"], "cache") if "/" not in k]
    no_traceback(ok)
    assert ok["rc"] == 0 and full["stdout"] == ok["stdout"]  # the same model, from memory then from the cache
    assert len([k for k in under(ok["files"], "cache") if "/" not in k]) == 1 and not staging(ok["files"])
    count("model cache (GGUF conversion), disk full", "one warning, same model, cached next run")


def test_small_writers_on_a_full_disk(runs: dict) -> None:
    for name, target in (("static-full", "scales.npz"), ("plot-full", "plot.png")):
        r = runs[name]
        no_traceback(r)
        errors = [ln for ln in r["stderr"].splitlines() if "error" in ln.lower()]
        assert r["rc"] == 2 and len(errors) == 1 and "EFBIG" in errors[0], r["stderr"]
        _no_output(r, target)
        count(f"{name.split('-')[0]} file ({target}), disk full", "one line, nothing written")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a chmod 555 folder")
def test_read_only_folder(runs: dict) -> None:
    one_line(runs["cal-read-only"], 2, "calibrate: error: cannot write", "EACCES")
    count("calibrate into a read-only folder", "one line, exit 2")


# ---- in process: the staging rules themselves


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_swap_interrupted_between_two_renames_is_undone(tmp_path: Path) -> None:
    """Where the one-step exchange is unavailable, a replace is two renames; a writer killed between them leaves
    NAME missing and the old NAME as .NAME.old-<pid>-...: the next write in that folder puts it back."""
    old = tmp_path / f".art.old-{_dead_pid()}-0123abcd"
    old.mkdir()
    (old / "f").write_text("old")
    (tmp_path / f".art.tmp-{_dead_pid()}-0123abcd").mkdir()  # the new one, staged, never renamed
    clean_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"] and (tmp_path / "art" / "f").read_text() == "old"
    count("two-rename swap killed between the renames", "old output restored by the next write")


def test_live_and_fresh_staging_is_left_alone(tmp_path: Path) -> None:
    mine = staging_path(tmp_path / "a")
    mine.mkdir()
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        live = tmp_path / f".b.tmp-{sleeper.pid}-0123abcd"
        live.mkdir()
        legacy_fresh = tmp_path / ".c.tmp-abcdefgh"
        legacy_fresh.mkdir()
        legacy_old = tmp_path / ".d.json.1a2b3c4d.tmp"  # an older version's staging of d.json, a day old
        legacy_old.write_text("{")
        other = tmp_path / ".other.1a2b3c4d.tmp"  # not d.json's: not ours to judge
        other.write_text("{")
        for p in (legacy_old, legacy_fresh, other):
            os.utime(p, (0, 0) if p != legacy_fresh else None)
        dead = tmp_path / f".e.tmp-{_dead_pid()}-0123abcd"
        dead.write_text("x")
        clean_stale(tmp_path, "d.json")
        clean_stale(tmp_path, "c")
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, live.name, legacy_fresh.name,
                                                                      other.name])
    finally:
        sleeper.kill()
        sleeper.wait()
    count("staging of a running writer, and of a dead one", "kept / removed")


def test_two_rename_fallback_replaces_completely(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvsqueeze.atomic_dir as atomic_dir

    monkeypatch.setattr(atomic_dir, "_exchange", lambda a, b: False)  # as on a platform without renameat2
    dest = tmp_path / "out"
    for text in ("one", "two"):
        with staged_directory(dest) as tmp:
            (tmp / "f").write_text(text)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (dest / "f").read_text() == "two"
    count("replace without renameat2", "complete, nothing left")


def test_library_errors_carrying_an_os_error_become_one_line() -> None:
    """safetensors' writer (Rust) reports a full disk as text: it is recognised like an OSError."""
    cause = RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space "
                         "left on device\" }) (os error 28)")
    err = disk_error(cause, "/x/y")
    assert isinstance(err, DiskWriteError) and "ENOSPC" in str(err) and "\n" not in str(err)
    assert disk_error(OSError(errno.EROFS, "ro"), "/x") is not None and disk_error(ValueError("no"), "/x") is None
    count("library error text with an os error code", "recognised")
