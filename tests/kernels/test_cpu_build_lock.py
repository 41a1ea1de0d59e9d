"""The C++ kernel's build: an interrupted build never makes a later process wait for ever; sources staged once per build."""

import os
import subprocess
import sys
import threading

import pytest

from kvsqueeze.kernels import cpu

pytest.importorskip("fcntl")


def test_stale_torch_lock_is_removed(tmp_path):
    build_dir = tmp_path / "ext"
    build_dir.mkdir()
    (build_dir / "lock").touch()  # what torch leaves when a build is killed: its FileBaton would wait on it
    with cpu._build_lock(build_dir):
        assert not (build_dir / "lock").exists()


def test_lock_of_a_killed_holder_is_released(tmp_path):
    build_dir = tmp_path / "ext"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path; from kvsqueeze.kernels.cpu import _build_lock\n"
         f"with _build_lock(Path({str(build_dir)!r})):\n    print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        entered = threading.Event()

        def take():
            with cpu._build_lock(build_dir):
                entered.set()

        waiter = threading.Thread(target=take, daemon=True)
        waiter.start()
        assert not entered.wait(0.5)  # held by the other process
        holder.kill()
        holder.wait()
        assert entered.wait(10)  # the kernel released it with the process
    finally:
        holder.kill()


def test_a_build_leaves_the_flags_and_so_every_build_name_alone(monkeypatch, tmp_path):
    """torch's load() appends its own link flags to the list it is given: were that list the module's, every later
    build name in the process would change (another path rebuilt under a new name, describe() naming a folder that
    does not exist)."""
    import torch.utils.cpp_extension as cpp_extension

    def fake_load(name, sources, extra_cflags, extra_ldflags, **kwargs):
        extra_cflags.append("-DADDED")
        extra_ldflags.append("-ltorch_cpu")  # as torch's _prepare_ldflags does
        return object()

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("KVSQUEEZE_NO_CPP", raising=False)
    monkeypatch.setattr(cpu, "_exts", {})
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    names = {isa: cpu._build_name(isa) for isa in cpu.runnable_isas()}
    assert cpu.load_extension(isa="generic") is not None
    assert {isa: cpu._build_name(isa) for isa in names} == names


def test_sources_staged_in_the_build_folder_and_left_alone_when_unchanged(tmp_path):
    """The build compiles a copy kept in its own folder, so checkouts with identical sources share one build;
    an unchanged copy keeps its mtime (ninja would rebuild otherwise), a stale one is replaced."""
    main = cpu._stage_sources(tmp_path)
    originals = sorted(cpu._SOURCE.parent.glob("*.[ch]*"))
    assert main == tmp_path / "src" / cpu._SOURCE.name
    assert [(f.name, f.read_bytes()) for f in originals] == \
        [(f.name, f.read_bytes()) for f in sorted((tmp_path / "src").iterdir())]
    before = {f.name: f.stat().st_mtime_ns for f in (tmp_path / "src").iterdir()}
    os.utime(main, ns=(1, 1))
    main.write_bytes(b"// stale\n")
    cpu._stage_sources(tmp_path)
    assert main.read_bytes() == cpu._SOURCE.read_bytes()
    after = {f.name: f.stat().st_mtime_ns for f in (tmp_path / "src").iterdir()}
    assert {k: v for k, v in after.items() if k != main.name} == {k: v for k, v in before.items() if k != main.name}
