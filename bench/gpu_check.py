"""``python -m bench.gpu_check RESULTS``: the one-GPU check's table (``.ci/gpu_check.sh``).

One row per paper entry that a ``gpu/*`` preset answers (system, metric, ours, paper,
device/backend), then one row per system of the GPU smoke. Exit 1 when a preset has no ok
record or a smoke job failed; the table is printed either way.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from bench.gpu_smoke import rows as smoke_rows, where
from bench.paper import find_ours, load_papers
from bench.record import created_key, load_records

# The one-GPU presets (conf/experiment/gpu/<name>.yaml), in the order the check runs them.
GPU_PRESETS = ("fisedit_sd15", "fisedit_sd21_768", "caraserve_7b", "swiftdiffusion_sd15", "ckpt_recovery")
HEAD = ["system", "metric", "ours", "paper", "device/backend"]


def _fmt(v: Optional[float], unit: str) -> str:
    if v is None:
        return "-"
    text = f"{v:.3g}"
    return f"{text}x" if unit == "x" else f"{text} {unit}".rstrip()


def preset_rows(records: list[dict]) -> list[list[str]]:
    """Every paper entry whose match names a gpu/* experiment, with our value and where it ran."""
    by_id = {r["run_id"]: r for r in records}
    out = []
    for system, paper in sorted(load_papers().items()):
        for e in paper.entries:
            if not any(m.experiment.startswith("gpu/") for m in e.match):
                continue
            ours = find_ours(e, records)
            ran = by_id.get(ours.run_ids[0]) if ours.run_ids else None
            metric = f"{e.name} ({e.match[0].metric})"
            value = _fmt(ours.value, e.unit) if ours.found else f"- ({ours.note})"
            paper_text = e.paper_text() + (" [target]" if e.kind == "target" else "")
            out.append([system, metric, value, paper_text, where(ran) if ran else "-"])
    return out


def status_rows(records: list[dict]) -> tuple[list[list[str]], list[str]]:
    """One line per gpu/* preset (how many of its jobs ended ok, else the first error) and the
    presets that have no record or a job that did not end ok."""
    out, bad_presets = [], []
    for name in GPU_PRESETS:
        mine = sorted((r for r in records if r.get("experiment") == f"gpu/{name}"), key=created_key)
        if not mine:
            out.append([f"gpu/{name}", "status", "missing", "-", "no record"])
            bad_presets.append(name)
            continue
        ok = sum(r["status"] == "ok" for r in mine)
        bad = next((r for r in mine if r["status"] != "ok"), None)
        why = "" if bad is None else (bad.get("error") or "; ".join(bad.get("invalid_reasons") or []))[:90]
        out.append([f"gpu/{name}", "status", f"{ok}/{len(mine)} ok", "-", why or where(mine[-1])])
        if bad is not None:
            bad_presets.append(name)
    return out, bad_presets


def format_table(table: list[list[str]], head: Sequence[str] = HEAD) -> str:
    widths = [max(len(h), *(len(r[i]) for r in table)) if table else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, table)])


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    records = load_records(args[0] if args else "results/runs/gpu_check")
    status, bad_presets = status_rows(records)
    smoke = [[r[0], "smoke", r[1], "-", r[2] if r[1] == "ok" else f"{r[2]} {r[4]}".strip()]
             for r in smoke_rows(records)]
    print(format_table(preset_rows(records) + status + smoke))
    return 1 if bad_presets or any(r[2] in ("failed", "missing") for r in smoke) else 0


if __name__ == "__main__":
    sys.exit(main())
