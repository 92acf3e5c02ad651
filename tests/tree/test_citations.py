"""Citations a reader of the repository can follow: no docstring, comment, config or README
cites the design notes the harness was built from (``spec 2.2``, ``spec hydraulis 9``, ``hotspa.md``),
since a user of the repository does not have them. A claim cites the paper (arXiv id, section,
figure), the authors' code, or a file in the repository (a system's README states the reconstructed
choices).

``python tests/tree/test_citations.py [PATH ...]`` lists the offending lines under the given paths."""
from __future__ import annotations

import pathlib
import re
import sys

from impl.common.systems import systems

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCANNED = ("impl", "bench", "faults", "conf", "containers", "tests", "README.md", ".ci")
SUFFIXES = {".py", ".yaml", ".yml", ".md", ".sh", ".toml", ".txt", ".cfg"}
_DOCS = rf"({'|'.join((*systems(), 'harness'))})"  # the design notes were named after the systems
PATTERNS = [
    re.compile(r"\bspec([ -](§|\d)|§)", re.I),             # spec 2.2, spec §5, spec-6
    re.compile(rf"\bspecs? {_DOCS}\b", re.I),                # spec hydraulis 9
    re.compile(rf"(?<![/\w]){_DOCS}\.md\b", re.I),           # hotspa.md (a spec file, not a README)
    re.compile(r"shared/(specs|seeds)\b"),
    re.compile(r"\bthe specs?('s)?\b(?! (of|for) )", re.I),  # "the spec's target"
    re.compile(r"(?<![\w.])\(spec\)|\bspec's\b", re.I),   # "(spec)" in prose, not f(spec)
]
THIS = pathlib.Path(__file__).resolve()


def offenders(paths=None) -> list[str]:
    roots = [ROOT / p for p in (paths or SCANNED)]
    files = []
    for r in roots:
        if r.is_file():
            files.append(r)
        elif r.is_dir():
            files.extend(f for f in sorted(r.rglob("*")) if f.is_file() and f.suffix in SUFFIXES)
    out = []
    for f in files:
        if f.resolve() == THIS or "__pycache__" in f.parts:
            continue
        for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if any(p.search(line) for p in PATTERNS):
                out.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()[:140]}")
    return out


def test_no_citation_of_documents_outside_the_repository():
    bad = offenders()
    assert not bad, f"{len(bad)} lines cite the design notes (not in the repository):\n" + "\n".join(bad[:40])


if __name__ == "__main__":
    found = offenders(sys.argv[1:] or None)
    print("\n".join(found))
    print(f"{len(found)} lines", file=sys.stderr)
