"""One name per role: module names that say what a file holds, and class names that do
not repeat across packages. The module graph comes from grimp (what import-linter reads)."""
from __future__ import annotations

import ast
import collections
import importlib.util
import pathlib

import grimp

PACKAGES = ("impl", "bench", "faults")
# Role-less or role-duplicating module names: a pricing module is `cost.py` (or a `cost/` package),
# and nothing is an `engine.py` (it meant five different things).
BANNED_MODULES = {"engine", "cost_model", "costmodel", "pricing", "sim_cost"}


def _modules() -> list[str]:
    graph = grimp.build_graph(*PACKAGES)
    return sorted(m for m in graph.modules if m.split(".")[0] in PACKAGES)


def _classes(module: str) -> list[str]:
    spec = importlib.util.find_spec(module)
    path = pathlib.Path(spec.origin)
    return [n.name for n in ast.parse(path.read_text(encoding="utf-8")).body if isinstance(n, ast.ClassDef)]


def test_no_module_has_a_role_less_name():
    bad = [m for m in _modules() if m.rsplit(".", 1)[-1] in BANNED_MODULES]
    assert not bad, f"rename for what they hold: {bad}"


def test_class_names_do_not_repeat_across_packages():
    where: dict[str, set[str]] = collections.defaultdict(set)
    for m in _modules():
        for name in _classes(m):
            where[name].add(m)
    repeats = sorted(name for name, mods in where.items() if len(mods) > 1)
    assert not repeats, "classes of the same name in two modules: " + "; ".join(f"{n}: {sorted(where[n])}" for n in repeats)
