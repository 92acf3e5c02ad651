"""The fidelity store: each family's latest measured sim-vs-real error, per host.

One JSON file, ``<results_dir>/fidelity.json`` by default (top-level key ``fidelity_store``),
written atomically under a file lock by every valid fidelity job and read by
:mod:`bench.provenance` for every sim record::

    {"schema": "mlsys-bench.fidelity/1",
     "hosts": {"<hostname>": {"<family>": {"<situation> | <workload> | <fault>": {
         "run_id", "date", "host", "rows": [{"metric", "real", "sim", "sim_over_real", "error_pct"}]}}}}}

A family's fidelity (what a sim record carries) is summarised over its latest situations:
the worst and mean |error %| of their headline metrics, the newest date, the host.
"""
from __future__ import annotations

import json
import os
import pathlib
import socket
import statistics
import tempfile
from typing import Any, Optional

from filelock import FileLock

SCHEMA = "mlsys-bench.fidelity/1"
DEFAULT_NAME = "fidelity.json"


def store_path(cfg_value: Optional[str], results_dir: str | os.PathLike) -> pathlib.Path:
    return pathlib.Path(cfg_value) if cfg_value else pathlib.Path(results_dir) / DEFAULT_NAME


def _read(path: pathlib.Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {"schema": SCHEMA, "hosts": {}}
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return {"schema": SCHEMA, "hosts": {}}
    data.setdefault("hosts", {})
    return data


def situation_key(situation: str, workload: Optional[str] = None, fault: Optional[str] = None) -> str:
    """A store key per measured case: one situation is run on several workloads or faults (two
    mask ratios, with and without a link delay); keyed by the situation alone, the newest would
    replace the others and a family's worst error could drop out of every sim record."""
    return " | ".join(str(x) for x in (situation, workload, fault) if x not in (None, ""))


def update(path: pathlib.Path, family: str, situation: str, entry: dict, host: Optional[str] = None) -> None:
    """Replace ``(host, family, situation)`` with ``entry`` (run_id, date, rows)."""
    host = host or socket.gethostname()
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        data = _read(path)
        data["hosts"].setdefault(host, {}).setdefault(family, {})[situation] = {**entry, "host": host}
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)


def family_fidelity(path: pathlib.Path, family: Optional[str], host: Optional[str] = None) -> Optional[dict]:
    """The family's latest measured fidelity on this host, or None when never measured here."""
    if not family:
        return None
    host = host or socket.gethostname()
    situations = _read(path)["hosts"].get(host, {}).get(family) or {}
    errors = [abs(r["error_pct"]) for s in situations.values() for r in s.get("rows", [])
              if r.get("error_pct") is not None]
    if not errors:
        return None
    return {"max_abs_error_pct": round(max(errors), 2), "mean_abs_error_pct": round(statistics.fmean(errors), 2),
            "situations": len(situations), "host": host,
            "date": max(s["date"] for s in situations.values()),
            "within_10pct": sum(e <= 10.0 for e in errors), "rows": len(errors)}


def provenance_entry(path: pathlib.Path, family: Optional[str]) -> dict[str, Any]:
    """What ``provenance.fidelity`` holds: the family, and its latest fidelity or null."""
    return {"family": family, "latest": family_fidelity(path, family), "store": str(path)}
