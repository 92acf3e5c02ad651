"""The README's layout (the tree block and the shared-substrate paragraph) matches the tree: every
path it names exists, and every package of impl/common is named."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def _substrate() -> str:
    start = README.index("Shared substrate (`impl/common/`)")
    return README[start:README.index("\n\n", start)]


def test_every_top_level_path_of_the_layout_block_exists():
    block = re.search(r"```\n(.*?)```", _section("Layout"), re.S).group(1)
    paths = [line.split()[0] for line in block.splitlines() if line.strip() and not line.startswith(" ")]
    assert paths, "the Layout section has no tree block"
    missing = [p for p in paths if "<" not in p and not (ROOT / p).exists()]
    assert not missing, f"README Layout names paths that do not exist: {missing}"


def test_the_substrate_paragraph_names_every_common_package_and_nothing_else():
    text = _substrate()
    named = set(re.findall(r"`([a-z_]+)/`", text))
    files = set(re.findall(r"`([a-z_]+\.py)`", text))
    common = ROOT / "impl" / "common"
    packages = {p.name for p in common.iterdir() if (p / "__init__.py").exists()}
    assert named - packages == set(), f"named but not packages of impl/common: {sorted(named - packages)}"
    assert packages - named == set(), f"packages of impl/common the README does not name: {sorted(packages - named)}"
    missing = [f for f in files if not list(common.rglob(f))]
    assert not missing, f"files the README names that impl/common does not hold: {missing}"
