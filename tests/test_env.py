"""kvsqueeze env: its JSON keys, and that it reports without building the C++ kernel unless asked."""

from __future__ import annotations

import json

from kvsqueeze.cli import main
from kvsqueeze.commands import env
from kvsqueeze.kernels import cpu


def test_env_json_keys(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))  # nothing built there: must not build
    built = []
    monkeypatch.setattr(cpu, "load_extension", lambda *a, **k: built.append(1))
    monkeypatch.setattr(cpu, "_exts", {})  # as in a fresh process, whatever earlier tests loaded or failed to build
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("KVSQUEEZE_DATA", raising=False)
    monkeypatch.setenv("KVSQUEEZE_CACHE", str(tmp_path / "cache"))
    assert main(["env", "--json", "-"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert tuple(info) == env.KEYS
    assert set(info["versions"]) == set(env.PACKAGES)
    assert info["versions"]["torch"] and info["versions"]["transformers"]
    assert info["transformers"]["cache_argument"] in ("cache", "past_key_values")
    assert {"model", "features", "kernel_paths_runnable"} <= set(info["cpu"])
    assert info["cpu"]["kernel_paths_runnable"] == cpu.runnable_isas()
    k = info["cpu_kernel"]
    assert {"built", "isa", "path", "runnable", "reason", "build_dir", "compiler", "ninja"} <= set(k)
    assert k["built"] is False and k["isa"] == cpu.selected_isa() and not built
    assert {"available", "torch_cuda", "gpu"} <= set(info["cuda"])
    assert {"installed", "version", "usable", "interpreter", "decode_launch", "codes16", "prefill_dense",
            "warning"} <= set(info["triton"])
    assert set(info["attention_path"]) == {"cpu", "cuda", "full_precision_caches"}
    assert info["corpus"]["name"] == "python-docs"  # offline, no WikiText-2 anywhere
    assert info["model_cache"]["root"] == str(tmp_path / "cache" / "models")


def test_env_names_a_built_kernel_path(capsys, monkeypatch):
    monkeypatch.setattr(cpu, "describe", lambda build=True: {
        "built": True, "isa": "avx2", "path": "C++ kernel (avx2)", "runnable": ["avx2", "generic"], "reason": None,
        "build_dir": "/x"})
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "CPU tensors -> cpu-kernel avx2" in out


def test_env_names_the_decode_launch_and_warns_of_triton_36_at_one_warp(capsys, monkeypatch):
    """The Triton decode's launch shape and codes16 switch are printed; a one-warp shape with Triton 3.6 (whose
    miscompile gave misaligned addresses on an H200, docs/gpu.md) is warned about, two warps are not."""
    from kvsqueeze.kernels import triton_decode

    real = env._version
    monkeypatch.setattr(env, "_version", lambda dist: "3.6.0" if dist == "triton" else real(dist))
    monkeypatch.setattr(triton_decode, "NUM_WARPS", 1)
    monkeypatch.setattr(triton_decode, "TARGET_PROGRAMS", 4096)
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "decode launch 32:4096:1:256 (KVSQUEEZE_TRITON_DECODE)" in out and "Triton 3.6 miscompile" in out
    monkeypatch.setattr(triton_decode, "NUM_WARPS", 2)
    assert main(["env"]) == 0
    assert "miscompile" not in capsys.readouterr().out


def test_env_names_the_prefill_route_and_a_bad_setting(capsys, monkeypatch):
    """The prefill's dense-route switch is printed as set; a value it does not take is named, not raised."""
    monkeypatch.setenv("KVSQUEEZE_TRITON_PREFILL_DENSE", "1")
    assert main(["env"]) == 0
    assert "prefill's dense route: 1 (KVSQUEEZE_TRITON_PREFILL_DENSE)" in capsys.readouterr().out
    monkeypatch.setenv("KVSQUEEZE_TRITON_PREFILL_DENSE", "always")
    assert main(["env"]) == 0
    assert "prefill's dense route: invalid (KVSQUEEZE_TRITON_PREFILL_DENSE='always'; allowed: auto, 1, 0)" in \
        capsys.readouterr().out
