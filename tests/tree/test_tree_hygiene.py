"""What the tree holds besides working code: no built package committed, and no comment that
cites an issue-tracker number (a reader of the repository cannot open the tracker; a comment
says what the thing is, or names a README section)."""
from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ISSUE_NUMBER = re.compile(r"\b[Ii]ssues? #?\d+")
THIS = pathlib.Path(__file__).resolve()  # its planted examples match
SCANNED = (("impl", "*.py"), ("bench", "*.py"), ("faults", "*.py"), ("tests", "*.py"), ("conf", "*.yaml"))


def issue_citations(root: pathlib.Path) -> list[str]:
    """``path:line: text`` of every line under ``root`` that cites an issue by number."""
    hits = []
    for folder, pattern in SCANNED:
        for path in sorted((root / folder).rglob(pattern)):
            if "__pycache__" in path.parts or path.resolve() == THIS:
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                if ISSUE_NUMBER.search(line):
                    hits.append(f"{path.relative_to(root)}:{n}: {line.strip()[:120]}")
    return hits


def test_no_comment_cites_an_issue_number():
    hits = issue_citations(ROOT)
    assert not hits, f"{len(hits)} lines cite an issue by number:\n" + "\n".join(hits)


def test_a_planted_issue_citation_is_found(tmp_path):
    (tmp_path / "impl").mkdir()
    (tmp_path / "impl" / "m.py").write_text("x = 1\n# the bound (Issue 12) holds\n")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "a.yaml").write_text("# see issue #3\nk: 1\n# issues of the paper\n")
    assert issue_citations(tmp_path) == ["impl/m.py:2: # the bound (Issue 12) holds", "conf/a.yaml:1: # see issue #3"]


def test_no_wheel_is_tracked():
    # a developer installs a tool from its registry; the tree carries no built package
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "*.whl", "*.egg"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == []
