"""Random-weight architectures for timings without downloads, and the --device / --random-weights options."""

from __future__ import annotations

import json

import pytest
import torch

from kvsqueeze.cli import main
from kvsqueeze.random_models import CONFIGS, random_model

# published parameter counts (model cards): the shapes are the architectures they name
PUBLISHED = {"llama-3.1-8b": 8.03e9, "qwen2.5-7b": 7.62e9, "mistral-7b": 7.25e9, "smollm2-135m": 134.5e6}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_shapes_have_their_published_sizes(name):
    model = random_model(name, device="meta")  # shapes only: no memory
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - PUBLISHED[name]) / PUBLISHED[name] < 0.005
    assert model.random_weights == name


def test_layers_and_config_files(tmp_path):
    fields = dict(CONFIGS["smollm2-135m"], num_hidden_layers=3, vocab_size=1000)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    model = random_model(str(path), layers=2, dtype=torch.float32)
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == 1000
    out = model(torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, 1000) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="allowed: llama-3.1-8b"):
        random_model("llama-9b")
    path.write_text("{}")
    with pytest.raises(ValueError, match="model_type"):
        random_model(str(path))


def test_speed_with_random_weights_says_so(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["speed", "--random-weights", "smollm2-135m", "--layers", "2", "--kv", "kivi-4", "--context", "64",
                 "--decode-tokens", "2", "--json", str(out)]) == 0
    assert "RANDOM WEIGHTS (2 layers)" in capsys.readouterr().out
    rec = json.loads(out.read_text())
    assert rec["model"]["random_weights"] is True and rec["model"]["name"] == "smollm2-135m"
    assert rec["model"]["num_layers"] == 2 and rec["model"]["device"] == "cpu"


@pytest.mark.parametrize("argv,line", [
    (["--random-weights", "smollm2-135m", "--model", "x"], "exclude each other"),
    (["--layers", "2"], "--layers needs --random-weights"),
    (["--random-weights", "nope"], "unknown --random-weights shape 'nope'"),
])
def test_bad_combinations_are_one_line(capsys, argv, line):
    assert main(["speed", "--kv", "kivi-4", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert line in err and len(err.splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_device_cuda_without_a_gpu_is_refused(capsys):
    assert main(["speed", "--kv", "kivi-4", "--device", "cuda"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_static_peer_runs_and_only_compileable_caches_compile(tmp_path, capsys):
    out = tmp_path / "s.json"
    base = ["speed", "--random-weights", "smollm2-135m", "--layers", "2", "--context", "32", "--decode-tokens", "2"]
    assert main([*base, "--kv", "hf-static", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["compiled"] is False and rec["kv_bytes"]["tokens"] == 34 and rec["attention_path"] == "sdpa"
    # preallocated to the run's length (32 + 2 + 1 tokens): its bytes count what it holds, not what it uses
    assert rec["kv_bytes"]["bits_per_element"] > 32
    capsys.readouterr()
    assert main([*base, "--kv", "hf-quanto-int4", "--compile"]) == 2  # transformers' quanto cache: not compileable
    assert "hf-quanto-int4 cache is not compileable" in capsys.readouterr().err


def test_kvsqueeze_specs_compile_as_the_static_cache(tmp_path):
    """`speed --compile --kv kivi-4`: the decode step compiled (inductor on a CPU) over StaticQuantizedCache, the
    attention on the C++ kernel (or the reference where no compiler builds it), bytes of the whole allocation."""
    out = tmp_path / "s.json"
    assert main(["speed", "--random-weights", "smollm2-135m", "--layers", "2", "--context", "200", "--decode-tokens",
                 "3", "--kv", "kivi-4", "--compile", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["compiled"] is True and rec["kv_bytes"]["tokens"] == 203
    assert rec["attention_path"].startswith(("cpu-kernel", "reference")), rec["attention_path"]
    # 224 rows (204 tokens rounded up to 32-token groups) of 4-bit codes for 2 layers x 3 KV heads x 64 dims
    assert rec["kv_bytes"]["codes"] == 2 * 2 * 3 * 224 * 32
