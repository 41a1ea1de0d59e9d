"""The tiny random models of every family: kept in :mod:`kvsqueeze.eval.families` (benchmarks/family_table.py
uses them too, and benchmarks never import from tests/); re-exported here for the tests."""

from kvsqueeze.eval.families import COMMON, FAMILIES, build, random_value_transform

__all__ = ["COMMON", "FAMILIES", "build", "random_value_transform"]
