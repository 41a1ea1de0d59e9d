"""The package's layers read top to bottom: a static scan of every import (lazy ones inside functions included).

base (errors, version, cache root) -> leaves (spec, RoPE, layout, corpus, models, random models, transforms) -> quant (formats)
-> artifact -> resolve -> cache -> kernels -> adapter -> {calibrate, eval, engines}
-> commands/cli -> the public ``kvsqueeze`` namespace.  An import may only point to a lower layer or stay inside
its own part; calibrate, eval and engines sit side by side and never import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvsqueeze

ROOT = Path(kvsqueeze.__file__).parent

# part -> layer rank (the first dotted component under kvsqueeze; modules and sub-packages alike)
RANKS = {
    "_version": 0, "errors": 0, "user_cache": 0, "heap": 0,
    "atomic_dir": 0.5,  # atomic writes raise the DiskWriteError of errors
    "external": 1,
    "spec": 1, "rope": 1, "corpus": 1, "models": 1, "random_models": 1, "transforms": 1,
    "layout": 1.5,  # reads a model's attention facts, RoPE tables included
    "quant": 2,
    "artifact": 3, "resolve": 4,
    "cache": 5,
    "kernels": 6,
    "adapter": 7,
    "calibrate": 8, "eval": 8, "engines": 8,
    "commands": 9, "cli": 10,
    "__init__": 11, "__main__": 11,
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str, path: Path) -> set[str]:
    """Every kvsqueeze module ``name`` imports, at module level or inside functions."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "kvsqueeze")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "kvsqueeze":
                continue
            for alias in node.names:  # `from pkg import module` imports the module, not the package's namespace
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in MODULES else target)
    return {m for m in out if m in MODULES}


def _part(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


EDGES = sorted((src, dst) for src, path in MODULES.items() for dst in _imports(src, path))


def test_every_part_has_a_rank():
    assert {_part(m) for m in MODULES} <= set(RANKS), {_part(m) for m in MODULES} - set(RANKS)


def test_imports_point_down_only():
    upward = [f"{src} -> {dst}" for src, dst in EDGES
              if _part(src) != _part(dst) and RANKS[_part(dst)] >= RANKS[_part(src)]]
    assert not upward, "imports that point up or sideways:\n" + "\n".join(upward)


def test_no_cycle_between_parts():
    graph: dict[str, set[str]] = {}
    for src, dst in EDGES:
        if _part(src) != _part(dst):
            graph.setdefault(_part(src), set()).add(_part(dst))
    seen, stack = set(), []

    def visit(node: str) -> None:
        if node in stack:
            pytest.fail("import cycle: " + " -> ".join(stack[stack.index(node):] + [node]))
        if node in seen:
            return
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt)
        stack.pop()
        seen.add(node)

    for node in sorted(graph):
        visit(node)


def test_kernels_read_formats_and_plans_only():
    """Kernels never import a codec or a cache: only the storage formats and the segment plan's types."""
    bad = [f"{src} -> {dst}" for src, dst in EDGES if _part(src) == "kernels" and _part(dst) == "cache"
           and dst != "kvsqueeze.cache.plan"]
    assert not bad, bad


def test_only_the_adapter_touches_transformers_internals():
    """transformers' cache, mask, attention-registry and integration modules are the adapter's alone; the one
    exception is layout.py reading a config's layer types with transformers' own config helper."""
    internal = ("transformers.cache_utils", "transformers.masking_utils", "transformers.modeling_utils",
                "transformers.integrations")
    users = set()
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [(a.name, "") for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                found = [(node.module or "", a.name) for a in node.names]
            else:
                continue
            for module, attr in found:
                if module.startswith(internal) and (name, attr) != ("kvsqueeze.layout", "get_layer_types_and_kwargs"):
                    users.add(name)
    assert users <= {"kvsqueeze.adapter"}, users


def test_the_scan_sees_lazy_imports():
    """The scan is not vacuous: a lazy import inside a function is an edge (the adapter's kernel modules, the
    Triton encoder imported on first use)."""
    assert ("kvsqueeze.adapter", "kvsqueeze.kernels.triton_pack") in EDGES
    assert len(EDGES) > 100
