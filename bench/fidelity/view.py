"""``mlsys-bench-compare --fidelity``: the sim-vs-real rows of fidelity records, one table and
one PNG (sim against real per headline metric, log axes, the ±10% band around sim = real)."""
from __future__ import annotations

import pathlib
from typing import Any, Optional

from bench.record import created_key

BAND = 0.10


def fidelity_rows(records: list[dict], include_invalid: bool = True) -> list[dict[str, Any]]:
    """One row per (newest record of each family, situation, fault) x headline metric."""
    newest: dict[tuple, dict] = {}
    for rec in sorted(records, key=created_key):
        fid = (rec.get("info") or {}).get("fidelity")
        if not fid or rec.get("status") == "failed" or (rec.get("status") == "invalid" and not include_invalid):
            continue
        newest[(fid["family"], fid["situation"], rec.get("workload"), rec.get("fault"))] = rec
    rows = []
    for rec in newest.values():
        fid = rec["info"]["fidelity"]
        host = ((rec.get("provenance") or {}).get("host") or {}).get("hostname", "?")
        for r in fid["rows"]:
            rows.append({"family": fid["family"], "situation": fid["situation"], "fault": rec.get("fault"),
                         "workload": rec.get("workload"), "metric": r["metric"], "unit": r.get("unit", ""),
                         "real": r["real"], "sim": r["sim"], "error_pct": r["error_pct"],
                         "status": rec["status"], "host": host, "date": rec["created"][:10],
                         "run_id": rec["run_id"], "invalid_reasons": rec.get("invalid_reasons") or []})
    return sorted(rows, key=lambda r: (r["family"], r["situation"], str(r["workload"]), str(r["fault"]), r["metric"]))


def format_rows(rows: list[dict]) -> str:
    head = ["family", "situation", "workload", "fault", "metric", "real", "sim", "error %", "status", "host", "date"]
    body = [[r["family"], r["situation"], str(r.get("workload") or ""), str(r["fault"]), r["metric"], f"{r['real']:.4g} {r['unit']}".strip(),
             f"{r['sim']:.4g} {r['unit']}".strip(), f"{r['error_pct']:+.1f}", r["status"], r["host"], r["date"]]
            for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)]) + "\n"


def plot_rows(rows: list[dict], path: pathlib.Path) -> Optional[pathlib.Path]:
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    vals = [v for r in rows for v in (r["real"], r["sim"]) if v > 0]
    lo, hi = min(vals) / 1.5, max(vals) * 1.5
    xs = [lo, hi]
    ax.plot(xs, xs, color="black", lw=1, label="sim = real")
    ax.fill_between(xs, [x * (1 - BAND) for x in xs], [x * (1 + BAND) for x in xs], color="tab:green",
                    alpha=0.15, label="±10%")
    markers = {"pipeline": "o", "hybrid": "s", "serving": "^", "diffusion": "D"}
    for k, fam in enumerate(sorted({r["family"] for r in rows})):
        color = f"C{k}"
        for valid in (True, False):
            pts = [r for r in rows if r["family"] == fam and (r["status"] == "ok") == valid]
            if pts:  # hollow markers: the real run was invalid (host contended)
                ax.scatter([p["real"] for p in pts], [p["sim"] for p in pts], marker=markers.get(fam, "x"),
                           edgecolors=color, facecolors=color if valid else "none",
                           label=fam if valid else f"{fam} (invalid)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("real (measured)")
    ax.set_ylabel("sim (hardware=local)")
    ax.set_title("Simulator fidelity: sim vs real, per headline metric")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
