"""``python -m bench.gpu_smoke RESULTS``: the GPU smoke's table (experiment=gpu_smoke), one row
per system package (:func:`impl.common.systems.systems`): status, device and backend the job ran
on, duration, and the error or invalid reason. Exit 1 when a job failed or a system has no record."""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from bench.record import created_key, load_records
from impl.common.systems import systems


def where(rec: dict) -> str:
    """Where the job's work ran: its placements' label (``cpu/gloo: 1 GPU < 4 ranks``), else the
    device and backend the job reported, else the host's first device (records before the
    execution decision)."""
    info = rec.get("info") or {}
    label = (info.get("execution") or {}).get("label")
    if label:
        return str(label)
    device = info.get("device") or next(iter((rec.get("provenance") or {}).get("devices") or []), {}).get("type", "?")
    backend = info.get("backend")
    return f"{device}/{backend}" if backend else str(device)


def rows(records: list[dict]) -> list[list[str]]:
    newest: dict[str, dict] = {}
    for rec in sorted((r for r in records if r.get("experiment") == "gpu_smoke"), key=created_key):
        smoke = next((o.split("=", 1)[1] for o in rec.get("overrides", []) if o.startswith("smoke=")), "adaptra")
        newest[smoke] = rec
    out = []
    # One smoke job per system (conf/smoke/<system>.yaml, swept by glob): a system without a
    # record is missing, whichever systems the records name.
    for name in systems():
        rec = newest.get(name)
        if rec is None:
            out.append([name, "missing", "", "", "no record"])
            continue
        why = rec.get("error") or "; ".join(rec.get("invalid_reasons") or [])
        out.append([name, rec["status"], where(rec), f"{rec.get('duration_s', 0):.1f}", why[:100]])
    return out


def format_rows(table: list[list[str]]) -> str:
    head = ["system", "status", "device/backend", "s", "error / invalid reason"]
    widths = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, table)])


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    table = rows(load_records(args[0] if args else "results/runs/gpu_smoke"))
    print(format_rows(table))
    return 1 if any(r[1] in ("failed", "missing") for r in table) else 0


if __name__ == "__main__":
    sys.exit(main())
