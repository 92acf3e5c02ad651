"""The layering contract of pyproject.toml ([tool.importlinter]) holds, and a back-import breaks it.

The linter runs in a subprocess on a copy of the tree, so it sees exactly the files there (the
planted module is never written into the real tree) and nothing this process has imported.
"""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
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
    assert "Contracts: 3 kept, 0 broken." in out.stdout


def test_back_import_from_common_breaks_it(tree_copy):
    target = tree_copy / "impl" / "common" / "schedule" / "ir.py"
    target.write_text(target.read_text() + "\n\ndef _planted():\n    from impl.adaptra import builder\n")
    out = _lint(tree_copy)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "impl.common is not allowed to import impl.adaptra" in out.stdout
    assert "impl.common.schedule.ir -> impl.adaptra.builder" in out.stdout


def test_system_importing_another_breaks_it(tree_copy):
    (tree_copy / "impl" / "malleus" / "planted.py").write_text("from impl.caraserve import system\n")
    out = _lint(tree_copy)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "no system imports another BROKEN" in out.stdout
    assert "impl.malleus.planted -> impl.caraserve.system" in out.stdout


def test_undeclared_system_package_breaks_it(tree_copy):
    (tree_copy / "impl" / "newsys").mkdir()
    (tree_copy / "impl" / "newsys" / "__init__.py").write_text("")
    out = _lint(tree_copy)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "- impl.newsys" in out.stdout
