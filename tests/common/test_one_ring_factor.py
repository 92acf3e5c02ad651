"""No pricer under impl/ writes its own ring factor or NCCL bus-bandwidth rule: collectives are
priced by impl/common/collectives.py only (like tests/tree/test_citations.py, a grep over the sources)."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
# (n - 1) / n, 2.0 * (tp - 1) / tp, (R-1)/R ...: a ring's share of the buffer per rank
RING = re.compile(r"\(\s*(\w+)\s*-\s*1\s*\)\s*/\s*\(?\s*\1\b")
ALLOWED = {"impl/common/collectives.py"}


def offenders() -> list[str]:
    out = []
    for path in sorted((ROOT / "impl").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if RING.search(code) and '"""' not in line and not code.strip().startswith(("forward", "-")):
                out.append(f"{rel}:{i}: {line.strip()}")
    return out


def test_ring_factors_live_in_the_collectives_module_only():
    assert offenders() == []


def test_the_guard_sees_a_ring_factor():
    assert RING.search("t = 2.0 * (n - 1) / n * nbytes / bw")
    assert RING.search("x * (dp - 1) / dp")
    assert not RING.search("(n - 1) / m")
