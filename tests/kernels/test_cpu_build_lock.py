"""The C++ kernel's build lock: an interrupted build never makes a later process wait for ever."""

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
