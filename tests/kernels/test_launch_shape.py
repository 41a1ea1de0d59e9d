"""The Triton decode's launch shape: ``KVSQUEEZE_TRITON_DECODE`` and attention_micro's ``--gpu-configs`` take
``BLOCK_T:TARGET_PROGRAMS:NUM_WARPS[:CHUNK[:STAGES]]`` through one parser, which names what is allowed when refusing; the
prefill's ``KVSQUEEZE_TRITON_PREFILL=BLOCK_M:BLOCK_N:NUM_WARPS`` likewise."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvsqueeze.kernels import triton_decode

from ._helpers import script_env


def test_a_launch_shape_is_parsed_with_the_modules_chunk_by_default():
    assert triton_decode.parse_launch("16:4096:1") == (16, 4096, 1, triton_decode.CHUNK, 0)
    assert triton_decode.parse_launch("64:1024:8:512") == (64, 1024, 8, 512, 0)
    assert triton_decode.parse_launch("32:4096:1:256:1") == (32, 4096, 1, 256, 1)


@pytest.mark.parametrize("shape", [(32, 1024, 4, 256, 0), (32, 4096, 1, 512, 2)])
def test_the_current_launch_shape_is_printed_as_the_parser_reads_it(shape, monkeypatch):
    for name, value in zip(("BLOCK_T", "TARGET_PROGRAMS", "NUM_WARPS", "CHUNK", "NUM_STAGES"), shape):
        monkeypatch.setattr(triton_decode, name, value)
    assert triton_decode.parse_launch(triton_decode.launch_text()) == shape


@pytest.mark.parametrize("text", ["", "32", "32:1024", "x:1024:4", "24:1024:4", "8:1024:4", "32:1024:3",
                                  "32:0:4", "32:1024:4:16", "32:1024:4:256:9",
                                  "32:1024:4:256:1:1"])
def test_a_bad_launch_shape_is_refused_naming_the_form(text):
    with pytest.raises(ValueError, match="BLOCK_T"):
        triton_decode.parse_launch(text)


def _launch_shape(module: str, names: str, variable: str, env_value: str) -> subprocess.CompletedProcess:
    """A fresh interpreter with ``variable=env_value`` imports kvsqueeze.kernels.``module`` and prints ``names``."""
    code = f"from kvsqueeze.kernels import {module} as t; print({', '.join('t.' + n for n in names.split())})"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=script_env(**{variable: env_value}), timeout=300)


def _module_shape(env_value: str) -> subprocess.CompletedProcess:
    return _launch_shape("triton_decode", "BLOCK_T TARGET_PROGRAMS NUM_WARPS CHUNK", "KVSQUEEZE_TRITON_DECODE",
                         env_value)


def test_the_environment_sets_the_launch_shape_or_is_refused_in_one_line():
    ok = _module_shape("16:4096:1:128")
    assert ok.returncode == 0 and ok.stdout.split() == ["16", "4096", "1", "128"], ok.stderr
    bad = _module_shape("16:x")
    assert bad.returncode != 0 and "KVSQUEEZE_TRITON_DECODE: a decode launch shape is" in bad.stderr


def _prefill_shape(env_value: str) -> subprocess.CompletedProcess:
    return _launch_shape("triton_prefill", "BLOCK_M BLOCK_N NUM_WARPS", "KVSQUEEZE_TRITON_PREFILL", env_value)


def test_the_prefill_launch_shape_comes_from_the_environment():
    ok = _prefill_shape("64:32:4")
    assert ok.returncode == 0 and ok.stdout.split() == ["64", "32", "4"], ok.stderr


@pytest.mark.parametrize("text", ["64:32", "x:32:4", "48:32:4", "64:8:4", "64:32:3"])
def test_a_bad_prefill_launch_shape_is_refused_naming_the_form(text):
    bad = _prefill_shape(text)
    assert bad.returncode != 0 and "KVSQUEEZE_TRITON_PREFILL" in bad.stderr and "BLOCK_M" in bad.stderr, bad.stderr
