"""What the report's page builders share: record ownership, number formatting, figure entries.

Kept apart from :mod:`bench.report.build` so that a section module (e.g.
:mod:`bench.report.hinge_section`) and the builder both import it, not each other.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

HARNESS = "harness"  # records of no paper's package (the calibration job)
MODE_WORD = {"sim": "simulated", "real": "measured"}
# Fidelity records (system=harness/fidelity, bench/fidelity) carry per headline metric m the metrics
# real__m, sim__m, sim_over_real__m and error_pct__m, and the rows in info.fidelity.
FIDELITY_METRIC = re.compile(r"^error_pct__")


def owner(rec: dict) -> str:
    """The paper package a record belongs to, from its system's ``_target_`` (demo/* runs are
    ADAPTRA's systems, so they land on its page)."""
    fid = (rec.get("info") or {}).get("fidelity") or {}
    # A fidelity record belongs to the paper whose system it measured for real.
    target = str(fid.get("real_target") or ((rec.get("config") or {}).get("system") or {}).get("_target_") or "")
    parts = target.split(".")
    if len(parts) > 2 and parts[0] == "impl" and parts[1] != "common":
        return parts[1]
    exp = str(rec.get("experiment", ""))
    return exp.split("/")[0] if "/" in exp else HARNESS


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "x"


def fmt(value: Optional[float], unit: str = "") -> str:
    if value is None:
        return "-"
    if unit == "fraction" and -1.5 <= value <= 1.5:
        return f"{100 * value:.4g}%"
    text = f"{value:.4g}"
    return text + ("x" if unit == "x" else f" {unit}" if unit else "")



@dataclass
class Figure:
    src: str
    caption: str
