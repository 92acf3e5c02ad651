"""Cross-paper questions (presets and their README in conf/experiment/cross/): systems from different
papers on one situation, as one table per question.

A row is one situation (a fault, or a workload), a column one system; a cell is the system's
headline metric, marked simulated or measured, or ``not applicable`` where the system refused
the situation in preflight (``record.not_applicable``; its one line is listed under the table),
or ``failed``. The last columns name the winner of the row and its margin over the runner-up.

Used as the presets' ``figure`` hook (``bench.cross:figure``: printed when a multirun ends, with
a PNG and a markdown copy in the sweep folder) and by the report's cross-paper page.
"""
from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import Optional

from bench.record import created_key


@dataclass(frozen=True)
class Question:
    experiment: str
    title: str
    row: str  # record field naming the situation: fault | workload
    metric: str
    better: str  # lower | higher
    extra: tuple[str, ...] = ()  # more metrics shown per cell (same record)
    command: str = ""


QUESTIONS = {
    q.experiment: q for q in (
        Question("cross/stragglers", "Stragglers: one DP4 x PP8 7B job, three straggler kinds", "fault",
                 "iteration_time_s", "lower", command="mlsys-bench --multirun experiment=cross/stragglers"),
        Question("cross/stragglers_cpu", "Stragglers, measured: the 4-rank CPU pipeline job, a slow link and a slow GPU",
                 "fault", "iteration_time_s", "lower", command="mlsys-bench --multirun experiment=cross/stragglers_cpu"),
        Question("cross/gpu_loss", "Losing GPUs: one 32-GPU job loses 1, 4 and 8 GPUs", "fault",
                 "t_lost_s", "lower", extra=("ettr", "throughput_kept"),
                 command="mlsys-bench --multirun experiment=cross/gpu_loss"),
        Question("cross/varlen", "Variable lengths: one length distribution per dataset, one cluster", "workload",
                 "throughput_tokens_per_s", "higher", command="mlsys-bench --multirun experiment=cross/varlen"),
    )
}
MODE_WORD = {"sim": "simulated", "real": "measured"}


@dataclass
class CrossCell:
    system: str
    status: str  # ok | not applicable | failed | invalid
    value: Optional[float] = None
    unit: str = ""
    mode: str = ""
    extra: dict = field(default_factory=dict)
    why: str = ""

    def text(self) -> str:
        if self.status != "ok":
            return self.status
        return f"{_num(self.value)} {self.unit} ({MODE_WORD.get(self.mode, self.mode)})"


@dataclass
class CrossTable:
    question: Question
    systems: list[str]
    rows: dict[str, dict[str, CrossCell]]  # situation -> system -> cell

    def winner(self, situation: str) -> tuple[Optional[str], Optional[float], Optional[str]]:
        """(best system, its margin over the runner-up as x better, runner-up) of a row."""
        ok = [c for c in self.rows[situation].values() if c.status == "ok" and c.value is not None]
        if not ok:
            return None, None, None
        hi = self.question.better == "higher"
        ok.sort(key=lambda c: c.value, reverse=hi)
        if len(ok) == 1:
            return ok[0].system, None, None
        a, b = ok[0].value, ok[1].value
        margin = (a / b if hi else b / a) if a and b else None
        return ok[0].system, margin, ok[1].system

    def refusals(self) -> list[tuple[str, str, str]]:
        return [(sit, c.system, c.why) for sit, cells in self.rows.items() for c in cells.values()
                if c.status in ("not applicable", "failed")]


def _num(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if x == 0 or 0.01 <= abs(x) < 1e5:
        return f"{x:.4g}"
    return f"{x:.3e}"


def cross_table(records: list[dict], experiment: str) -> Optional[CrossTable]:
    q = QUESTIONS.get(experiment)
    if q is None:
        return None
    newest: dict[tuple[str, str], dict] = {}
    for rec in sorted((r for r in records if r.get("experiment") == experiment), key=created_key):
        newest[(str(rec.get(q.row)), str(rec.get("system")))] = rec
    systems = list(dict.fromkeys(s for _, s in newest))
    rows: dict[str, dict[str, CrossCell]] = {}
    for (sit, system), rec in newest.items():
        m = (rec.get("metrics") or {}).get(q.metric)
        if rec.get("not_applicable"):
            cell = CrossCell(system, "not applicable", why=str(rec.get("error") or ""))
        elif rec.get("status") == "failed" or m is None:
            cell = CrossCell(system, "failed", why=str(rec.get("error") or f"no metric {q.metric}"))
        elif rec.get("status") != "ok":
            cell = CrossCell(system, "invalid", why="; ".join(rec.get("invalid_reasons") or []))
        else:
            extra = {k: (rec["metrics"][k]["value"], rec["metrics"][k]["unit"]) for k in q.extra if k in rec["metrics"]}
            cell = CrossCell(system, "ok", float(m["value"]), str(m.get("unit", "")), str(rec.get("mode")), extra)
        rows.setdefault(sit, {})[system] = cell
    return CrossTable(q, systems, dict(sorted(rows.items())))


def table_rows(t: CrossTable) -> tuple[list[str], list[list[str]]]:
    head = [t.question.row, *t.systems, "best", "margin"]
    body = []
    for sit, cells in t.rows.items():
        best, margin, runner = t.winner(sit)
        row = [sit]
        for s in t.systems:
            c = cells.get(s)
            text = c.text() if c else "-"
            if c and c.extra:
                text += "; " + ", ".join(f"{k} {_num(v)} {u}" for k, (v, u) in c.extra.items())
            row.append(text)
        row += [best or "-", f"{margin:.2f}x over {runner}" if margin else "-"]
        body.append(row)
    return head, body


def format_cross(t: CrossTable, markdown: bool = False) -> str:
    head, body = table_rows(t)
    q = t.question
    lines = [f"{q.title} ({q.metric}, {q.better} is better)"]
    if markdown:
        lines = [f"### {lines[0]}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in body]
    else:
        widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in [head, *body]]
    refused = t.refusals()
    if refused:
        lines.append("")
        lines += [f"{'- ' if markdown else ''}{t.rows[sit][system].status}: {system} on {sit}: {why}"
                  for sit, system, why in refused]
    if q.command:
        lines += ["", f"reproduce: `{q.command}`" if markdown else f"reproduce: {q.command}"]
    return "\n".join(lines)


def plot_cross(t: CrossTable, path: pathlib.Path) -> pathlib.Path:
    """One group of bars per situation, one bar per system (hatched = simulated, solid =
    measured); a system that does not apply gets an 'n/a' mark at zero."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sits = list(t.rows)
    n = max(len(t.systems), 1)
    w = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(sits) * n / 3), 3.8))
    labelled: set = set()
    for j, s in enumerate(t.systems):
        for i, sit in enumerate(sits):
            c = t.rows[sit].get(s)
            x = i + (j - (n - 1) / 2) * w
            if c and c.status == "ok":
                ax.bar(x, c.value, w, color=f"C{j}", hatch="//" if c.mode == "sim" else None,
                       edgecolor="black", linewidth=0.5, label=None if s in labelled else s)
                labelled.add(s)
            else:
                ax.text(x, 0, "n/a" if c and c.status == "not applicable" else "x", ha="center", va="bottom",
                        fontsize=7, rotation=90, color=f"C{j}")
        if s not in labelled:
            ax.bar(0, 0, 0, color=f"C{j}", label=f"{s} (n/a)")
    ax.set_xticks(range(len(sits)), sits, fontsize=8)
    unit = next((c.unit for cells in t.rows.values() for c in cells.values() if c.unit), "")
    ax.set_ylabel(f"{t.question.metric} ({unit}; {t.question.better} is better)")
    ax.set_title(f"{t.question.title}\nhatched = simulated, solid = measured, n/a = refused in preflight", fontsize=9)
    ax.legend(fontsize=7, ncol=min(n, 4))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figure(records: list[dict], out_dir: pathlib.Path) -> list[pathlib.Path]:
    """The presets' figure hook: print the cross table, write it as markdown and draw it."""
    out: list[pathlib.Path] = []
    for exp in dict.fromkeys(str(r.get("experiment")) for r in records):
        t = cross_table(records, exp)
        if t is None:
            continue
        print()
        print(format_cross(t))
        slug = exp.replace("/", "_")
        md = out_dir / f"{slug}.md"
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(format_cross(t, markdown=True) + "\n", encoding="utf-8")
        out += [md, plot_cross(t, out_dir / f"{slug}.png")]
    return out
