"""Counts of robustness cases, printed at the end of a run (``pytest tests/robustness``;
``KVSQUEEZE_ROBUSTNESS_COUNTS=FILE`` also writes them as JSON)."""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict

COUNTS: dict[str, Counter] = defaultdict(Counter)


def record(kind: str, outcome: str, n: int = 1) -> None:
    COUNTS[kind][outcome] += n


def dump() -> None:
    path = os.environ.get("KVSQUEEZE_ROBUSTNESS_COUNTS")
    if path:
        with open(path, "w") as f:
            json.dump({k: dict(v) for k, v in COUNTS.items()}, f, indent=1)
