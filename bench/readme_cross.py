"""The top-level README's cross-paper figures, written from records by ``mlsys-bench-readme``.

The text between ``<!-- cross-paper:begin -->`` and ``<!-- cross-paper:end -->`` is one compact
table per cross-paper question (``bench/cross.py``, presets in ``conf/experiment/cross/``): per
situation each system's headline figure, the winner and its margin over the next best, then the
systems that refused a situation ("not applicable") with their one line. Nothing in it is typed
by hand: the figures, winners, margins and refusals are what :func:`bench.cross.cross_table` reads
from the records (the newest record per situation and system).

The records come from the same kept reference set as the systems table
(``bench/data/reference_records.jsonl.gz``): :func:`compact_cross` cuts a cross record to what
``bench/cross.py`` reads, so the section is rebuilt and checked offline.
"""
from __future__ import annotations

import textwrap
from typing import Optional

from bench.cross import MODE_WORD, QUESTIONS, CrossCell, CrossTable, cross_table

BEGIN = "<!-- cross-paper:begin -->"
END = "<!-- cross-paper:end -->"
# What bench.cross reads from a record (the question's row field is `fault` or `workload`;
# `created` and `run_id` order records, newest wins). Metrics are cut to the question's own
# (headline and extras), each to value and unit.
KEEP = ("run_id", "created", "experiment", "system", "mode", "status", "error", "not_applicable",
        "invalid_reasons", "workload", "fault")
CELL_WORD = {"not applicable": "n/a"}
WIDTH = 100  # the README's prose width (a table row is one line whatever its length)


def _wrap(text: str, indent: str = "") -> str:
    return textwrap.fill(text, WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def is_cross(rec: dict) -> bool:
    return rec.get("experiment") in QUESTIONS


def compact_cross(rec: dict) -> dict:
    """``rec`` (a cross question's record) cut to the fields the cross table reads."""
    q = QUESTIONS[rec["experiment"]]
    names = {q.metric, *q.extra}
    small = {k: rec[k] for k in KEEP if k in rec}
    small["metrics"] = {n: {k: v for k, v in met.items() if k in ("value", "unit")}
                        for n, met in sorted((rec.get("metrics") or {}).items()) if n in names}
    git = ((rec.get("provenance") or {}).get("git") or {})
    # The footer names the commit the figures came from.
    small["provenance"] = {"git": {k: git.get(k) for k in ("commit", "dirty")}}
    return small


def questions(records: list[dict], spec: Optional[dict] = None) -> list[str]:
    """The cross experiments to show: those the reference set names (so a missing run shows as
    one), then any other cross question the records answer; in bench.cross's order."""
    ref = (spec or {}).get("reference") or {}
    named = set(ref.get("presets") or []) | set(ref.get("skipped") or {})
    have = {r.get("experiment") for r in records}
    return [exp for exp in QUESTIONS if exp in named or exp in have]


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def _cell(c: Optional[CrossCell]) -> str:
    if c is None:
        return "-"
    if c.status != "ok":
        return CELL_WORD.get(c.status, c.status)
    return " / ".join([_num(c.value), *(_num(v) for v, _ in c.extra.values())])


def _situation(t: CrossTable, sit: str) -> str:
    return "none (no fault)" if t.question.row == "fault" and sit == "none" else sit


def _best(t: CrossTable, sit: str) -> tuple[str, str]:
    best, margin, runner = t.winner(sit)
    if best is None:
        return "-", "-"
    if margin is None:
        return f"`{best}`", "no other system ran it"
    return f"`{best}`", f"{margin:.2f}x over `{runner}` ({_num(t.rows[sit][runner].value)})"


def _modes(t: CrossTable) -> str:
    modes = sorted({c.mode for cells in t.rows.values() for c in cells.values() if c.status == "ok"})
    return " and ".join(MODE_WORD.get(m, m) for m in modes) or "no ok run"


def _refusals(t: CrossTable) -> list[str]:
    """One line per (system, status, why): the situations it refused, then its line."""
    grouped: dict[tuple[str, str, str], list[str]] = {}
    for sit, system, why in t.refusals():
        grouped.setdefault((system, t.rows[sit][system].status, why), []).append(sit)
    return [_wrap(f"- {status}: `{system}` on {', '.join(sits)}: {why or '(no line given)'}", "  ")
            for (system, status, why), sits in grouped.items()]


def question_text(t: CrossTable) -> str:
    q = t.question
    unit = next((c.unit for cells in t.rows.values() for c in cells.values() if c.unit), "")
    shown = " / ".join([f"{q.metric} ({unit + ', ' if unit else ''}{q.better} is better)", *q.extra])
    lines = [_wrap(f"**{q.title}** (`experiment={q.experiment}`, {_modes(t)}; cells: {shown}):"), "",
             "| " + " | ".join([q.row, *(f"`{s}`" for s in t.systems), "best", "margin over the next best"]) + " |",
             "|" + "---|" * (len(t.systems) + 3)]
    for sit, cells in t.rows.items():
        lines.append("| " + " | ".join([_situation(t, sit), *(_cell(cells.get(s)) for s in t.systems),
                                        *_best(t, sit)]) + " |")
    refused = _refusals(t)
    if refused:
        lines += [""] + refused
    return "\n".join(lines)


def render_cross(records: list[dict], spec: Optional[dict] = None, source: str = "") -> str:
    """The markdown between the cross-paper markers (without them)."""
    records = [r for r in records if is_cross(r)]
    skipped = ((spec or {}).get("reference") or {}).get("skipped") or {}
    parts = []
    for exp in questions(records, spec):
        t = cross_table(records, exp)
        if t is None or not t.rows:
            why = f" ({skipped[exp]})" if exp in skipped else ""
            parts.append(_wrap(f"**{QUESTIONS[exp].title}** (`experiment={exp}`): not in the reference set{why}."))
        else:
            parts.append(question_text(t))
    commits = sorted({str(((r.get("provenance") or {}).get("git") or {}).get("commit") or "?")[:10] for r in records})
    dates = sorted(str(r.get("created", ""))[:10] for r in records if r.get("created"))
    span = (dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}") if dates else "no dates"
    parts.append(_wrap(f"Written by `mlsys-bench-readme` from {source or 'the records given'} ({len(records)} cross "
                 f"records, {span}, commit {', '.join(commits) or '-'}) through `bench/cross.py`; do not edit "
                 f"between the markers. A cell is the newest record of that situation and system; n/a: the "
                 f"system refused the situation in preflight (its line is listed). Refresh: "
                 f"`mlsys-bench-readme --refresh` (or `--refresh --add --preset cross/<name>` for one question)."))
    return "\n\n".join(parts) + "\n"
