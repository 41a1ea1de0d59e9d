"""Shared by the interruption and full-disk tests: the real commands, at their smallest, and the driver run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from ._counts import record

ARTIFACT = "arts/tiny-model-vllm-fp8-e4m3-truncate-comp-rot"


def calibrate(model: Path) -> list[str]:
    return ["calibrate", "--model", str(model), "--method", "vllm-fp8", "--samples", "1", "--length", "32", "--out",
            "arts", "--quiet", "--threads", "1"]


def export_vllm(model: Path, artifact: Path) -> list[str]:
    return ["export", "--model", str(model), "--kv", str(artifact), "--quiet", "--vllm", "out"]


def ppl(model: Path, report: str = "report.json") -> list[str]:
    return ["ppl", "--model", str(model), "--kv", "int4", "--chunks", "1", "--context", "32", "--threads", "1",
            "--json", report]


def save_tiny_model(folder: Path) -> Path:
    """A random 2-layer Llama with a word-level tokenizer: every command runs on it in well under a second."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                      max_position_embeddings=1024)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(63)} | {"<unk>": 63}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w0", unk_token="<unk>").save_pretrained(folder)
    return folder
STAGING = re.compile(r"(^|/)\.[^/]+\.(tmp|old)-\d+-[0-9a-f]{8}$")
KIND = "interruption and full disk"


def run_plan(plan: list[dict], folder: Path, model: Path, env: dict | None = None,
             timeout: int = 600) -> dict[str, dict]:
    """Run the steps in one driver process (tests/robustness/_child.py), warmed up on ``model``; results by step
    name."""
    plan_file, result = folder / "plan.json", folder / "result.json"
    plan_file.write_text(json.dumps(plan))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"),
                                                        os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "KVSQUEEZE_TEST_TINY_MODEL": str(model), **(env or {})}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_child.py")), str(plan_file), str(result)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["name"]: r for r in json.loads(result.read_text())}


def staging(files: dict[str, str]) -> list[str]:
    return [f for f in files if STAGING.search(f)]


def under(files: dict[str, str], prefix: str) -> dict[str, str]:
    """The entries below ``prefix``, relative to it."""
    return {k[len(prefix) + 1:]: v for k, v in files.items() if k.startswith(prefix + "/")}


def no_traceback(r: dict) -> None:
    assert "Traceback" not in r["stderr"] and r["rc"] != 99, r["stderr"][-3000:]


def one_line(r: dict, rc: int, *needles: str) -> str:
    """The step ended with ``rc`` and a single stderr line holding every needle (progress bars aside)."""
    no_traceback(r)
    lines = [ln for ln in r["stderr"].splitlines() if ln.startswith("kvsqueeze")]
    assert r["rc"] == rc and len(lines) == 1, (r["rc"], r["stderr"][-2000:])
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


def count(case: str, outcome: str) -> None:
    record(KIND, f"{outcome}: {case}")
