"""Side-by-side comparison of records: terminal tables, ``report.md`` and one PNG per metric.

Rules, also stated in the output:
- records are grouped by (experiment, workload, hardware, fault, mode); only ``status: ok``
  records feed a table, and each group says how many failed/invalid records it left out;
- when a system has several ok records in a group, the newest (``created``) is shown;
- ratios read "x = times better than <baseline>", so >1 is better whichever way the metric
  goes: baseline/system for lower-is-better metrics, system/baseline for higher-is-better;
- without ``--baseline`` each group's baseline is its first system alphabetically;
- sim numbers are labelled "sim (simulated)" and never presented as measured.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import pathlib
import re
import shutil
import sys
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from bench.record import RecordError, created_key, load_records
from impl.common.plots.save import save_png

GROUP_FIELDS = ("experiment", "workload", "hardware", "fault", "mode")
MODE_LABEL = {"sim": "sim (simulated)", "real": "real (measured)"}
BASELINE_DEFAULT_NOTE = "first system alphabetically; choose with --baseline"
PROG = "mlsys-bench-compare"


@dataclass(frozen=True)
class GroupKey:
    experiment: str
    workload: str
    hardware: str
    fault: str
    mode: str

    def label(self) -> str:
        return " ".join(f"{f}={getattr(self, f)}" for f in GROUP_FIELDS[:-1]) + \
            f" mode={MODE_LABEL.get(self.mode, self.mode)}"

    def slug(self) -> str:
        """A file-name-safe id; the hash keeps keys that sanitise alike apart."""
        raw = "|".join(getattr(self, f) for f in GROUP_FIELDS)
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", "-".join(getattr(self, f) for f in GROUP_FIELDS))
        return f"{safe[:80]}-{hashlib.sha1(raw.encode()).hexdigest()[:6]}"


@dataclass
class CompareCell:
    """One system's value of one metric, and its ratio to the baseline (>1 = better)."""

    value: float
    unit: str
    better: str
    n: int
    p10: Optional[float]
    p90: Optional[float]
    ratio: Optional[float] = None


@dataclass
class CompareRow:
    system: str
    run_id: str
    created: str
    cells: dict[str, CompareCell]
    superseded: int = 0  # older ok records of this system in the group, not shown


@dataclass
class GroupTable:
    key: GroupKey
    baseline: Optional[str]  # the system ratios are relative to (None: no ok records)
    baseline_source: str  # "--baseline" or the default rule
    baseline_present: bool
    metrics: list[str]
    rows: list[CompareRow]
    excluded: dict[str, int] = field(default_factory=lambda: {"failed": 0, "invalid": 0})
    notes: list[str] = field(default_factory=list)
    # One line per invalid record left out: "system (run_id): why" (e.g. a contended host).
    invalid: list[str] = field(default_factory=list)

    @property
    def has_ratios(self) -> bool:
        """Whether the table has a ratio column: only with the baseline present in the group and
        something to compare it with (a one-system group would print its own 1.00x)."""
        return self.baseline_present and len(self.rows) > 1

    def unit(self, metric: str) -> str:
        for row in self.rows:
            if metric in row.cells:
                return row.cells[metric].unit
        return ""

    def better(self, metric: str) -> str:
        for row in self.rows:
            if metric in row.cells:
                return row.cells[metric].better
        return "lower"


# ------------------------------------------------------------------ grouping and ratios

def ratio(candidate: float, baseline: float, better: str) -> Optional[float]:
    """Times better than the baseline: >1 means the candidate is better."""
    if candidate < 0 or baseline < 0 or any(map(math.isnan, (candidate, baseline))):
        return None  # a ratio of signed quantities says nothing about "better"
    num, den = (baseline, candidate) if better == "lower" else (candidate, baseline)
    if den == 0:  # "infinitely better" helps nobody: show no ratio
        return 1.0 if num == 0 else None
    if num == 0:  # nor does "0.00x" (infinitely worse) against a zero baseline
        return None
    return num / den


def _natural(text: str) -> tuple:
    """Sort key that orders numbers inside labels by value (delay_s=0.0 before 0.06, 12 before 24)."""
    return tuple((0, float(tok), "") if re.fullmatch(r"\d+(?:\.\d+)?(?:e-?\d+)?", tok) else (1, 0.0, tok)
                 for tok in re.split(r"(\d+(?:\.\d+)?(?:e-?\d+)?)", text) if tok)


def _check(rec: dict, where: str) -> None:
    for f in (*GROUP_FIELDS, "system", "status"):
        if not isinstance(rec.get(f), str):
            raise RecordError(f"{where}: record {rec.get('run_id', '?')}: field {f!r} missing "
                              f"or not a string")
    if rec["status"] == "ok" and not isinstance(rec.get("metrics"), dict):
        raise RecordError(f"{where}: record {rec.get('run_id', '?')}: field 'metrics' missing")


def compare_records(records: Iterable[dict], baseline: Optional[str] = None, *,
                    metrics: Optional[Sequence[str]] = None, experiment: Optional[str] = None,
                    sweep: Optional[str] = None) -> list[GroupTable]:
    """Group records and compute ratios; filters keep only the named metrics/experiment/sweep."""
    ok: dict[GroupKey, dict[str, list[dict]]] = {}
    excluded: dict[GroupKey, dict[str, int]] = {}
    invalid: dict[GroupKey, list[str]] = {}
    for rec in records:
        _check(rec, "records")
        if experiment is not None and rec["experiment"] != experiment:
            continue
        if sweep is not None and rec.get("sweep") != sweep:
            continue
        key = GroupKey(*(rec[f] for f in GROUP_FIELDS))
        excluded.setdefault(key, {"failed": 0, "invalid": 0})
        by_system = ok.setdefault(key, {})
        if rec["status"] != "ok":
            excluded[key][rec["status"]] = excluded[key].get(rec["status"], 0) + 1
            if rec["status"] == "invalid":
                why = "; ".join(rec.get("invalid_reasons") or []) or "no reason given"
                invalid.setdefault(key, []).append(
                    f"{rec['system']} ({rec.get('run_id', '?')}): {why}")
            continue
        by_system.setdefault(rec["system"], []).append(rec)
    tables = [_table(key, ok[key], excluded[key], baseline, metrics) for key in
              sorted(ok, key=lambda k: tuple(_natural(getattr(k, f)) for f in GROUP_FIELDS))]
    for table in tables:
        table.invalid = invalid.get(table.key, [])
    return tables


def _table(key: GroupKey, by_system: dict[str, list[dict]], excluded: dict[str, int],
           baseline: Optional[str], metric_filter: Optional[Sequence[str]]) -> GroupTable:
    rows: list[CompareRow] = []
    for system in sorted(by_system):
        recs = sorted(by_system[system], key=created_key)
        newest = recs[-1]
        cells = {}
        for name, m in newest["metrics"].items():
            if metric_filter and name not in metric_filter:
                continue
            cells[name] = CompareCell(value=float(m["value"]), unit=str(m.get("unit", "")),
                               better=m.get("better", "lower"), n=int(m.get("n", 1)),
                               p10=m.get("p10"), p90=m.get("p90"))
        rows.append(CompareRow(system, newest.get("run_id", "?"), newest.get("created", ""), cells,
                        superseded=len(recs) - 1))
    source = "--baseline" if baseline else BASELINE_DEFAULT_NOTE
    chosen = baseline or (rows[0].system if rows else None)
    table = GroupTable(key, chosen, source, any(r.system == chosen for r in rows), [], rows,
                       dict(excluded))
    metrics: list[str] = []
    for row in rows:  # first-seen order keeps each system's own metric order
        metrics += [m for m in row.cells if m not in metrics]
    if metric_filter:
        metrics = [m for m in metric_filter if m in metrics]
    table.metrics = metrics
    # The baseline row first: it is the row every ratio refers to.
    table.rows.sort(key=lambda r: (r.system != chosen, r.system))
    _fill_ratios(table)
    return table


def _fill_ratios(table: GroupTable) -> None:
    if not table.rows:
        table.notes.append("no ok records in this group")
        return
    if not table.baseline_present:
        # A group the baseline never ran in (the calibration job) has no ratio column at all;
        # only a group of several systems says why, since there a ratio was to be expected.
        if len(table.rows) > 1:
            table.notes.append(f"baseline {table.baseline!r} has no ok record in this group: "
                               f"no ratios")
        return
    base = table.rows[0].cells
    for metric in table.metrics:
        b = base.get(metric)
        for row in table.rows:
            c = row.cells.get(metric)
            if c is None or b is None:
                continue
            if c.unit != b.unit or c.better != b.better:
                table.notes.append(f"{metric}: {row.system} reports {c.unit!r}/{c.better}, "
                                   f"baseline {b.unit!r}/{b.better}: no ratio")
                continue
            c.ratio = ratio(c.value, b.value, b.better)


# ------------------------------------------------------------------ formatting

def _num(x: float) -> str:
    if math.isinf(x):
        return "inf"
    return f"{x:.4g}"


def format_cell(cell: Optional[CompareCell]) -> str:
    if cell is None:
        return "-"
    text = _num(cell.value)
    # The spread only when there is one: a deterministic sim metric repeated n times has none.
    if cell.n > 1 and cell.p10 is not None and cell.p90 is not None and cell.p10 != cell.p90:
        text += f" [{_num(cell.p10)}..{_num(cell.p90)}]"
    return text


def format_ratio(cell: Optional[CompareCell]) -> str:
    if cell is None or cell.ratio is None:
        return "-"
    return "inf" if math.isinf(cell.ratio) else f"{cell.ratio:.2f}x"


def header_lines(table: GroupTable) -> list[str]:
    k = table.key
    lines = [k.label()]
    if table.has_ratios:
        b = table.baseline
        lines.append(f"x = times better than {b}; >1 is better ({b}/system for lower-is-better "
                     f"metrics, system/{b} for higher-is-better)")
        if table.baseline_source != "--baseline":
            lines.append(f"baseline {b}: {table.baseline_source}")
    if k.mode == "sim":
        lines.append("values are simulated (cost model + simulator), not measured")
    else:
        lines.append("values are measured: median [p10..p90] over repeats when n>1")
    ex = table.excluded
    if ex.get("failed") or ex.get("invalid"):
        lines.append(f"excluded: {ex.get('failed', 0)} failed, {ex.get('invalid', 0)} invalid "
                     f"record(s)")
    lines += [f"invalid, not compared: {line}" for line in table.invalid]
    for row in table.rows:
        if row.superseded:
            lines.append(f"{row.system}: newest of {row.superseded + 1} ok records shown "
                         f"({row.run_id})")
    lines += [f"note: {n}" for n in table.notes]
    return lines


def table_cells(table: GroupTable) -> tuple[list[str], list[list[str]]]:
    """The table as header + rows of strings, shared by the text and Markdown renderers."""
    head = ["system"]
    for m in table.metrics:
        unit = table.unit(m)
        better = "lower" if table.better(m) == "lower" else "higher"
        head += [f"{m} [{unit}, {better}=better]" if unit else f"{m} [{better}=better]"]
        head += ["x"] if table.has_ratios else []
    body = []
    for row in table.rows:
        name = row.system + (" (baseline)" if table.has_ratios and row.system == table.baseline else "")
        line = [name]
        for m in table.metrics:
            cell = row.cells.get(m)
            line += [format_cell(cell)] + ([format_ratio(cell)] if table.has_ratios else [])
        body.append(line)
    return head, body


def format_table(table: "GroupTable | Sequence[GroupTable]", markdown: bool = False,
                 width: Optional[int] = None) -> str:
    """One group's table as aligned text (or Markdown); a list of groups gives all of them.

    Text tables wider than ``width`` (default: the terminal's, 160 when not a terminal) are
    split into several tables of a few metrics each, every one with the system column.
    """
    if not isinstance(table, GroupTable):
        return format_tables(table, markdown, width)
    head, body = table_cells(table)
    if markdown:
        out = [f"### {table.key.label()}", ""]
        out += [f"- {line}" for line in header_lines(table)[1:]]
        out.append("")
        if body:
            out.append("| " + " | ".join(head) + " |")
            out.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|")
            out += ["| " + " | ".join(r) + " |" for r in body]
        return "\n".join(out) + "\n"
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    limit = width or shutil.get_terminal_size((160, 24)).columns
    chunks: list[list[int]] = []  # column indices per printed table; 0 is the system column
    step = 2 if table.has_ratios else 1
    for i in range(1, len(head), step):  # (value, x) column pairs stay together
        cols = list(range(i, i + step))
        used = sum(widths[j] + 2 for j in chunks[-1]) if chunks else 0
        if not chunks or used + sum(widths[j] + 2 for j in cols) > limit:
            chunks.append([0])
        chunks[-1] += cols

    def fmt(r: list[str], cols: list[int]) -> str:
        return "  ".join(r[j].ljust(widths[j]) if j == 0 else r[j].rjust(widths[j])
                         for j in cols).rstrip()

    lines = [f"== {header_lines(table)[0]} =="] + [f"   {x}" for x in header_lines(table)[1:]]
    for n, cols in enumerate(chunks if body else []):
        lines += [""] if n else []
        lines += [fmt(head, cols), "  ".join("-" * widths[j] for j in cols)]
        lines += [fmt(r, cols) for r in body]
    return "\n".join(lines) + "\n"


def format_tables(tables: Sequence[GroupTable], markdown: bool = False,
                  width: Optional[int] = None) -> str:
    return "\n".join(format_table(t, markdown, width) for t in tables)


# ------------------------------------------------------------------ plots and report

def plot_metric(table: GroupTable, metric: str, path: pathlib.Path) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    rows = [r for r in table.rows if metric in r.cells]
    cells = [r.cells[metric] for r in rows]
    values = [c.value for c in cells]
    lo = [max(0.0, c.value - c.p10) if c.n > 1 and c.p10 is not None else 0.0 for c in cells]
    hi = [max(0.0, c.p90 - c.value) if c.n > 1 and c.p90 is not None else 0.0 for c in cells]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(rows) + 2), 3.8))
    colors = ["tab:gray" if table.has_ratios and r.system == table.baseline else "tab:blue" for r in rows]
    spread = [lo, hi] if any(lo) or any(hi) else None  # no whiskers for single samples
    # Simulated bars hatched, measured ones solid: a sim number never looks measured.
    sim = table.key.mode == "sim"
    bars = ax.bar([r.system for r in rows], values, yerr=spread, capsize=4, color=colors,
                  hatch="//" if sim else None, edgecolor="white" if sim else None,
                  label=MODE_LABEL.get(table.key.mode, table.key.mode))
    ax.legend(fontsize=7, loc="best")
    for bar, c, top in zip(bars, cells, hi):
        if c.ratio is not None:  # above the whisker, so the label never hides it
            ax.annotate(format_ratio(c), (bar.get_x() + bar.get_width() / 2, c.value + top),
                        ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                        textcoords="offset points")
    unit = table.unit(metric)
    ax.set_ylabel(f"{metric} [{unit}] ({table.better(metric)} is better)" if unit else metric)
    ax.set_xlabel(f"system (grey: baseline {table.baseline}; labels: x better; whiskers: p10..p90)"
                  if table.has_ratios else "system (whiskers: p10..p90; no baseline in this group)", fontsize=8)
    ax.margins(y=0.12)
    k = table.key
    ax.set_title(f"{k.experiment} | {k.workload} | {k.hardware} | fault={k.fault}\n"
                 f"mode={MODE_LABEL.get(k.mode, k.mode)}", fontsize=9)
    save_png(fig, path, dpi=100)
    return path


def write_report(tables: Sequence[GroupTable], out_dir: pathlib.Path,
                 source: str = "") -> pathlib.Path:
    """``report.md`` plus ``compare-<group>-<metric>.png`` per metric per group."""
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = ["# mlsys-bench comparison", ""]
    if source:
        parts += [f"Records: `{source}`. Only `status: ok` records are compared; the newest "
                  f"record per system and group is shown.", ""]
    for table in tables:
        parts.append(format_table(table, markdown=True))
        for metric in table.metrics:
            if not any(metric in r.cells for r in table.rows):
                continue
            name = f"compare-{table.key.slug()}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', metric)}.png"
            plot_metric(table, metric, out_dir / name)
            parts += [f"![{metric}]({name})", ""]
    report = out_dir / "report.md"
    report.write_text("\n".join(parts), encoding="utf-8")
    return report


# ------------------------------------------------------------------ command line

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                epilog="Ratios: x = times better than the baseline (>1 better). "
                                       "Without --baseline, each group's baseline is its first "
                                       "system alphabetically. The newest ok record per system "
                                       "and group is shown.")
    p.add_argument("--results", default="results/runs", help="results dir (default %(default)s)")
    p.add_argument("--baseline", help="system the ratios are relative to")
    p.add_argument("--experiment", help="only this experiment")
    p.add_argument("--sweep", help="only records of this multirun (record field `sweep`)")
    p.add_argument("--metrics", action="append",
                   help="only these metrics (comma-separated; may repeat)")
    p.add_argument("--out", help="where report.md and PNGs go (default: the results dir)")
    p.add_argument("--no-report", action="store_true", help="print the tables only")
    p.add_argument("--fidelity", action="store_true",
                   help="the sim-vs-real view of fidelity records (family, situation, metric, real, sim, "
                        "error %%, host, date) and fidelity.png")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    results = pathlib.Path(args.results)
    if not results.is_dir():
        return _fail(f"results dir {results} does not exist (run `mlsys-bench` first)")
    try:
        records = load_records(results)
    except RecordError as exc:
        return _fail(str(exc))
    except json.JSONDecodeError as exc:  # a torn record.json (records.jsonl lines say file:line)
        return _fail(f"{results}/*/record.json: not valid JSON ({exc.msg})")
    if not records:
        return _fail(f"no records in {results} (run `mlsys-bench` first)")
    if args.fidelity:
        return _fidelity_view(records, results, pathlib.Path(args.out) if args.out else results, args.no_report)
    metrics = [m for arg in args.metrics or [] for m in arg.split(",") if m] or None
    try:
        tables = compare_records(records, args.baseline, metrics=metrics,
                                 experiment=args.experiment, sweep=args.sweep)
    except RecordError as exc:
        return _fail(f"{results}: {exc}")
    if not tables:
        return _fail(f"no records in {results} match the filters "
                     f"(experiment={args.experiment}, sweep={args.sweep})")
    n_ex = {s: sum(t.excluded.get(s, 0) for t in tables) for s in ("failed", "invalid")}
    print(f"{len(records)} records in {results}; {len(tables)} group(s); excluded "
          f"{n_ex['failed']} failed, {n_ex['invalid']} invalid; newest ok record per system "
          f"and group shown")
    print()
    print(format_tables(tables), end="")
    if not args.no_report:
        report = write_report(tables, pathlib.Path(args.out) if args.out else results,
                              source=str(results))
        print(f"\nreport: {report}")
    return 0


def _fidelity_view(records: list, results: pathlib.Path, out: pathlib.Path, no_plot: bool) -> int:
    from bench.fidelity.view import fidelity_rows, format_rows, plot_rows

    rows = fidelity_rows(records)
    if not rows:
        return _fail(f"no fidelity records in {results} (run `mlsys-bench --multirun experiment=fidelity/<family>`)")
    print(f"{len(rows)} sim-vs-real rows in {results}; newest record per family, situation, workload and fault; "
          f"error % = (sim - real) / real; invalid = the real run's host was contended")
    print()
    print(format_rows(rows), end="")
    if not no_plot:
        out.mkdir(parents=True, exist_ok=True)
        print(f"\nplot: {plot_rows(rows, out / 'fidelity.png')}")
    return 0


def _fail(msg: str) -> int:
    print(f"{PROG}: {msg}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
