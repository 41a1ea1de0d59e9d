"""`kvsqueeze static-generate` end to end on a tiny model saved to disk, and its bad-input errors."""

from __future__ import annotations

import re
import sys

import pytest

from kvsqueeze.cli import main

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def tiny_dir(static_llama, tiny_tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-model")
    static_llama.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(" ".join(f"w{(7 * i) % 250 + 2}" for i in range(600)))
    return path


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["static-generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_generates_and_reports(capsys, tiny_dir, calib_file, tmp_path):
    onnx_dir = tmp_path / "graphs"
    args = ["--prompt", "w5 w9 w13 w200", "--model", str(tiny_dir), "--max-len", "24", "--kv", "int8-static",
            "--max-new-tokens", "30", "--onnx-dir", str(onnx_dir), "--calib-text", str(calib_file),
            "--reserve", "1.5", "--on-full", "slide"]
    code, out, err = _run(capsys, *args)
    assert code == 0, err
    last = out.strip().splitlines()[-1]
    # 30 tokens = 29 decode steps; ceil(1.5 * 23) = 35 slots leave 12 free: (29 - 1) // 12 = 2 copies, each moving
    # the 23-token window of K and V in 2 layers at 2 heads x 64 uint8 codes per token (2 * 2 * 2 * 23 * 128 bytes);
    # buffers: 2 layers x K and V x 35 slots x 128 bytes
    tail = (r" steps; prefill \d+ ms\) generated=30 kv=int8-static S=24 reserve=1.5 copies=2 "
            r"bytes_moved=23552 staging_bytes=0 kv_buffer_bytes=17920 requantizations=0$")
    assert re.search(r"^tokens/s=\d+\.\d\d \(decode, onnxruntime CPU, \d+ threads, 29" + tail, last), last
    assert (onnx_dir / "decode.onnx").is_file()
    # the second run reuses the graphs (no export message)
    code, out2, err2 = _run(capsys, *args)
    assert code == 0 and "exporting" not in err2 and out2.splitlines()[0] == out.splitlines()[0]


def test_bad_input_is_one_line_exit_2(capsys, tiny_dir, calib_file, tmp_path, llama_factory):
    base = ["--model", str(tiny_dir), "--max-len", "8", "--onnx-dir", str(tmp_path / "g")]
    code, _, err = _run(capsys, "--prompt", " ".join(["w5"] * 8), *base)
    assert code == 2 and "S-1 = 7" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "g").exists()  # nothing exported for a prompt that cannot fit
    code, _, err = _run(capsys, "--prompt", "w5", *base[:-2], "--max-len", "1")
    assert code == 2 and "--max-len" in err
    # graphs of another model in an explicit --onnx-dir
    other = llama_factory(seed=3)
    from kvsqueeze.engines.onnx_export import export_static_graphs

    export_static_graphs(other, tmp_path / "other", 8)
    code, _, err = _run(capsys, "--prompt", "w5 w6", "--model", str(tiny_dir), "--max-len", "8",
                        "--onnx-dir", str(tmp_path / "other"))
    assert code == 2 and "another model" in err
    # same model, other settings
    code, _, err = _run(capsys, "--prompt", "w5 w6", "--model", str(tiny_dir), "--max-len", "9",
                        "--onnx-dir", str(tmp_path / "g2"))
    assert code == 0
    code, _, err = _run(capsys, "--prompt", "w5 w6", "--model", str(tiny_dir), "--max-len", "8",
                        "--onnx-dir", str(tmp_path / "g2"))
    assert code == 2 and "max_len: 9 (requested 8)" in err


def test_missing_onnxruntime_names_the_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # makes `import onnxruntime` fail
    code, _, err = _run(capsys, "--prompt", "w5")
    assert code == 2 and 'pip install -e ".[onnx]"' in err
