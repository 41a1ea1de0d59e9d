"""Print the family x calibrated-method table of docs/calibrated.md from the requirement checks themselves.

Each family is the tiny random model the tests use (kvsqueeze.eval.families, built from transformers' own config
classes); each cell is :func:`kvsqueeze.calibrate.requirements.verdict` on the facts read from that model
(:func:`kvsqueeze.layout.attention_facts`).  tests/test_families.py checks that every "works" cell calibrates,
saves, loads and runs, and that every "refused" cell raises exactly that reason.

    PYTHONPATH=src python3 benchmarks/family_table.py
"""

from __future__ import annotations

from kvsqueeze.calibrate.requirements import verdict
from kvsqueeze.eval.families import FAMILIES, build
from kvsqueeze.layout import attention_facts

COLUMNS = (("skvq", "skvq", None), ("kvquant", "kvquant", None), ("hybrid", "hybrid", None),
           ("invertible learned-folded / smooth", "invertible", ("learned-folded", "smooth")),
           ("invertible learned-online / hadamard / none", "invertible", ("learned-online", "hadamard", "none")))


def cell(facts, method: str, transforms: tuple[str, ...] | None) -> str:
    if transforms is None:
        return verdict(facts, method)
    parts = {t: verdict(facts, method, t) for t in transforms}
    if len(set(parts.values())) == 1:
        return next(iter(parts.values()))
    return "; ".join(f"{t}: {v}" for t, v in parts.items())


def main() -> None:
    print("| family (what it exercises) | " + " | ".join(c[0] for c in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for family, (what, *_rest) in FAMILIES.items():
        facts = attention_facts(build(family))
        cells = [cell(facts, method, transforms).replace("|", "/") for _, method, transforms in COLUMNS]
        print(f"| {family} ({what}) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
