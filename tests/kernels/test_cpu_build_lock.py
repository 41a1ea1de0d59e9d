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
