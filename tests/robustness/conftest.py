"""Print how many robustness cases ran, by kind and outcome (the table in docs/robustness.md)."""

from __future__ import annotations

from ._counts import COUNTS, dump


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not COUNTS:
        return
    terminalreporter.write_line("kvsqueeze robustness cases: " + "; ".join(
        f"{kind}: {sum(c.values())} ({', '.join(f'{o} {n}' for o, n in sorted(c.items()))})"
        for kind, c in sorted(COUNTS.items())))
    dump()
