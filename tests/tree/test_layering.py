"""The layering contract of pyproject.toml ([tool.importlinter]) holds, and a back-import breaks it.

The linter runs in a subprocess on a copy of the tree, so it sees exactly the files there (the
planted module is never written into the real tree) and nothing this process has imported.
"""
from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("bench", "faults", "impl")


def _lint(root: pathlib.Path) -> subprocess.CompletedProcess:
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--no-cache", "--config", str(root / "pyproject.toml")],
                          cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def tree_copy(tmp_path):
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "README.md", "*.yaml", "*.json")
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_every_source_folder_is_a_package():
    # the linter only sees regular packages: a folder of modules without __init__.py would
    # escape every contract (impl/common/llm and impl/fisedit did)
    missing = sorted(str(d.relative_to(ROOT)) for pkg in PACKAGES for d in (ROOT / pkg).rglob("*")
                     if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))
                     and not (d / "__init__.py").exists())
    assert not missing, f"folders with modules but no __init__.py: {missing}"


def test_tree_keeps_the_layering_contract(tree_copy):
    out = _lint(tree_copy)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Contracts: 5 kept, 0 broken." in out.stdout


# (module planted into, the import appended to it, the line naming the broken rule, the edge).
# faults sits above impl.common (the runtime reads fault specs from impl.common.fault_model), and
# a model builder never needs the runtime that runs it.
BACK_IMPORTS = {
    "common_imports_a_system": ("impl/common/schedule/ir.py", "\n\ndef _planted():\n    from impl.adaptra import builder\n",
                                "impl.common is not allowed to import impl.adaptra",
                                "impl.common.schedule.ir -> impl.adaptra.builder"),
    "common_imports_faults": ("impl/common/runtime/link_delay.py", "\nimport faults.varying_delay  # noqa\n",
                              "impl.common does not import faults BROKEN",
                              "impl.common.runtime.link_delay -> faults.varying_delay"),
    "model_imports_the_runtime": ("impl/common/models/tiny_gpt.py", "\nfrom impl.common.runtime import stage  # noqa\n",
                                  "impl.common.models does not import the runtime BROKEN",
                                  "impl.common.models.tiny_gpt -> impl.common.runtime.stage"),
}


@pytest.mark.parametrize("case", sorted(BACK_IMPORTS))
def test_back_import_breaks_it(tree_copy, case):
    path, planted, rule, edge = BACK_IMPORTS[case]
    target = tree_copy / path
    target.write_text(target.read_text() + planted)
    out = _lint(tree_copy)
    assert out.returncode == 1, out.stdout + out.stderr
    assert rule in out.stdout
    assert edge in out.stdout


def test_system_importing_another_breaks_it(tree_copy):
    (tree_copy / "impl" / "malleus" / "planted.py").write_text("from impl.caraserve import system\n")
    out = _lint(tree_copy)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "no system imports another, impl.common imports no system BROKEN" in out.stdout
    assert "impl.malleus.planted -> impl.caraserve.system" in out.stdout


def test_new_system_package_is_covered_without_being_declared(tree_copy):
    # no contract lists the systems: a new package under impl/ may use impl.common and faults
    # and is held to the same rules as the others the moment it exists
    new = tree_copy / "impl" / "newsys"
    new.mkdir()
    (new / "__init__.py").write_text("from impl.common import api\nimport faults.dp_link\n")
    assert _lint(tree_copy).returncode == 0
    (new / "planted.py").write_text("from impl.caraserve import system\n")
    out = _lint(tree_copy)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "impl.newsys.planted -> impl.caraserve.system" in out.stdout


def test_faults_importing_a_system_breaks_it(tree_copy):
    (tree_copy / "faults" / "planted.py").write_text("from impl.hotspa import system\n")
    out = _lint(tree_copy)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "faults imports no system BROKEN" in out.stdout
    assert "faults.planted -> impl.hotspa.system" in out.stdout


_CYCLES = """
import json, sys
import grimp, networkx
graph = grimp.build_graph(*sys.argv[1:], cache_dir=None)
g = networkx.DiGraph((m, i) for m in graph.modules for i in graph.find_modules_directly_imported_by(m))
print(json.dumps(sorted(sorted(c) for c in networkx.strongly_connected_components(g) if len(c) > 1)))
"""


def _import_cycles(root: pathlib.Path) -> list[list[str]]:
    """Every set of modules that import each other in a circle, lazy imports in functions
    included (grimp's graph: the static imports of every module, not the ones executed)."""
    import json

    out = subprocess.run([sys.executable, "-c", _CYCLES, *PACKAGES], cwd=root,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_no_import_cycle(tree_copy):
    # A circle forces lazy imports and makes the import order matter; what two modules both
    # need moves to a third (bench.record.created_key, impl/swiftdiffusion/sim/common.py).
    assert _import_cycles(tree_copy) == []


def test_planted_import_cycle_is_found(tree_copy):
    # one import in a function body is enough to close the circle
    (tree_copy / "bench" / "planted.py").write_text("def f():\n    from bench import summary\n")
    summary = tree_copy / "bench" / "summary.py"
    summary.write_text(summary.read_text() + "\nfrom bench import planted  # noqa\n")
    assert _import_cycles(tree_copy) == [["bench.planted", "bench.summary"]]


# The step model and the cost models import each other's pieces; an import inside a function
# body there would hide a circle that the pieces' placement is meant to rule out.
NO_DEFERRED_IMPORTS = ("impl/common/megatron", "impl/common/cost")


def _deferred_imports(root: pathlib.Path, folders) -> list[str]:
    """``path:line`` of every import statement inside a function body under ``folders``."""
    hits = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for fn in ast.walk(tree):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    hits += [f"{path.relative_to(root)}:{node.lineno}" for node in ast.walk(fn)
                             if isinstance(node, (ast.Import, ast.ImportFrom))]
    return sorted(set(hits))


def test_no_deferred_import_in_step_and_cost_models():
    assert _deferred_imports(ROOT, NO_DEFERRED_IMPORTS) == []


def test_planted_deferred_import_is_found(tmp_path):
    pkg = tmp_path / "impl" / "common" / "cost"
    pkg.mkdir(parents=True)
    (pkg / "planted.py").write_text("import math\n\n\ndef f():\n    if True:\n        from impl.common import megatron\n")
    assert _deferred_imports(tmp_path, NO_DEFERRED_IMPORTS[1:]) == ["impl/common/cost/planted.py:6"]
