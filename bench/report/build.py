"""Build the static report site from a results folder and the papers' numbers.

Layout of ``out/``: ``index.html`` (one row per system), ``<system>.html`` (paper vs ours, figures,
what the claims hinge on where a hinge experiment ran, every record), ``records/<run_id>.json``
(each record as read, so every link resolves offline), ``fig/`` (PNGs) and ``style.css``.
No script, no network: the pages are plain HTML.
"""
from __future__ import annotations

import collections
import datetime as _dt
import importlib
import json
import pathlib
import shutil
from dataclasses import dataclass, field
from typing import Optional

import jinja2

from bench.paper import Ours, PaperEntry, PaperFile, find_ours, load_papers
from bench.record import Skipped, created_key, scan_records
from bench.report.hinge_section import hinge_claims
from bench.report.pieces import FIDELITY_METRIC, HARNESS, MODE_WORD, Figure, fmt, owner, slug  # noqa: F401
from bench.report.plots import paper_vs_ours

@dataclass
class EntryRow:
    entry: PaperEntry
    ours: Ours
    experiment: str  # the first match's experiment pattern: the row's section on the page

    @property
    def paper_text(self) -> str:
        if self.entry.unit == "fraction":
            lo = fmt(self.entry.value, "fraction")
            return f"{lo}-{fmt(self.entry.high, 'fraction')}" if self.entry.high is not None else lo
        return self.entry.paper_text()

    @property
    def ours_text(self) -> str:
        return fmt(self.ours.value, self.entry.unit) if self.ours.found else ""

    @property
    def vs_paper(self) -> str:
        """Ours against the paper: ``x`` of the paper's value, or in/below/above a band."""
        if not self.ours.found:
            return ""
        v, e = self.ours.value, self.entry
        if e.at_least:
            return "in band" if v >= e.value else "below band"
        if e.high is not None:
            return "in band" if e.value <= v <= e.high else ("below band" if v < e.value else "above band")
        if e.value == 0:
            return ""
        return f"{v / e.value:.2f}x"

    @property
    def mode_word(self) -> str:
        return " + ".join(MODE_WORD.get(m, m) for m in (self.ours.mode or "").split("+") if m)


@dataclass
class RecordRow:
    rec: dict
    href: str
    source: str

    @property
    def status(self) -> str:
        # A job its system refused in preflight (a cross preset's "not applicable") is stored
        # as failed with not_applicable set: it is not a failure of the system.
        if self.rec.get("not_applicable"):
            return "not-applicable"
        return self.rec["status"]

    @property
    def why(self) -> str:
        if self.rec["status"] == "failed":
            return self.rec.get("error") or ""
        return "; ".join(self.rec.get("invalid_reasons") or [])

    @property
    def mode_word(self) -> str:
        return MODE_WORD.get(self.rec["mode"], self.rec["mode"])

    @property
    def emulated(self) -> list[str]:
        return list((self.rec.get("provenance") or {}).get("emulated") or [])

    @property
    def host(self) -> str:
        host = (self.rec.get("provenance") or {}).get("host") or {}
        name = host.get("hostname") or "?"
        cores = host.get("cpu_count")
        return f"{name} ({cores} cores)" if cores else name

    @property
    def commit(self) -> str:
        git = (self.rec.get("provenance") or {}).get("git") or {}
        c = git.get("commit")
        if not c:
            return "?"
        return c[:10] + (" (dirty)" if git.get("dirty") else "")


@dataclass
class SystemPage:
    name: str
    paper: Optional[PaperFile]
    records: list[RecordRow] = field(default_factory=list)
    entries: list[EntryRow] = field(default_factory=list)
    paper_figures: list[Figure] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)  # the system's own (figures.py)
    figure_errors: list[str] = field(default_factory=list)
    hinges: list = field(default_factory=list)  # hinge_section.HingeClaim per claim of a hinge experiment
    hinge_errors: list[str] = field(default_factory=list)

    @property
    def href(self) -> str:
        return f"{slug(self.name)}.html"

    @property
    def counts(self) -> dict[str, int]:
        return dict(collections.Counter(r.status for r in self.records))

    @property
    def modes(self) -> str:
        c = collections.Counter(r.rec["mode"] for r in self.records)
        return ", ".join(f"{MODE_WORD[m]} ({c[m]})" for m in ("real", "sim") if c[m]) or "none run yet"

    @property
    def headline(self) -> Optional[EntryRow]:
        if not self.paper:
            return None
        return next(r for r in self.entries if r.entry.name == self.paper.headline)

    @property
    def found(self) -> int:
        return sum(r.ours.found for r in self.entries)

    @property
    def fidelity(self) -> str:
        """The worst |sim - real| / real over the newest valid fidelity record of each
        situation, with how many rows, the host and the newest date."""
        newest: dict[tuple, dict] = {}
        for row in sorted(self.records, key=lambda r: created_key(r.rec)):
            fid = (row.rec.get("info") or {}).get("fidelity")
            if row.status == "ok" and fid:
                newest[(fid.get("situation"), row.rec.get("fault"), row.rec.get("workload"))] = row.rec
        errs = [abs(float(m["value"])) for rec in newest.values()
                for name, m in (rec.get("metrics") or {}).items() if FIDELITY_METRIC.match(name)]
        if not errs:
            return "not measured"
        last = max(newest.values(), key=created_key)
        host = ((last.get("provenance") or {}).get("host") or {}).get("hostname", "?")
        return (f"max |error| {max(errs):.1f}% over {len(errs)} metric(s) of {len(newest)} situation(s) "
                f"({host}, {str(last.get('created', ''))[:10]})")

    def sections(self) -> list[tuple[str, list[EntryRow]]]:
        """Entries grouped by experiment, the ones with our value first; in file order."""
        groups: dict[str, list[EntryRow]] = {}
        for row in self.entries:
            groups.setdefault(row.experiment, []).append(row)
        return sorted(groups.items(), key=lambda kv: not any(r.ours.found for r in kv[1]))


def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("bench.report", "templates"),
                             autoescape=jinja2.select_autoescape(["html", "j2"]),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["fmt"] = fmt
    return env


def _system_figures(page: SystemPage, out: pathlib.Path) -> None:
    """The system's own paper-style figure per experiment (its ``figure:`` setting), drawn from
    that experiment's records (figures pick ok records themselves)."""
    by_exp: dict[tuple[str, str], list[dict]] = {}
    for row in page.records:
        target = (row.rec.get("config") or {}).get("figure")
        if target:
            by_exp.setdefault((row.rec["experiment"], str(target)), []).append(row.rec)
    for (exp, target), recs in sorted(by_exp.items()):
        if not any(r["status"] == "ok" for r in recs):
            continue
        module, _, func = target.partition(":")
        fig_dir = out / "fig" / slug(page.name) / slug(exp)
        try:
            paths = getattr(importlib.import_module(module), func)(recs, fig_dir) or []
        except Exception as exc:  # one broken figure never costs the report
            page.figure_errors.append(f"{exp}: {target} failed: {type(exc).__name__}: {exc}")
            continue
        modes = sorted({MODE_WORD[r["mode"]] for r in recs if r["status"] == "ok"})
        for p in paths:
            page.figures.append(Figure(pathlib.Path(p).relative_to(out).as_posix(),
                                       f"{exp} ({' + '.join(modes)}): {target}"))


def _paper_figures(page: SystemPage, out: pathlib.Path) -> None:
    for exp, rows in page.sections():
        drawn = [r for r in rows if r.ours.found]
        if not drawn:
            continue
        data = [dict(label=r.entry.name + (f" ({r.entry.kind})" if r.entry.kind != "paper" else ""), unit=r.entry.unit, paper=r.entry.value, high=r.entry.high,
                     ours=r.ours.value, mode=r.ours.mode) for r in drawn]
        path = paper_vs_ours(data, out / "fig" / slug(page.name) / f"paper_vs_ours-{slug(exp)}.png",
                             f"{page.name} {exp}: the paper's numbers and ours")
        page.paper_figures.append(Figure(path.relative_to(out).as_posix(), f"{exp}: the paper's numbers (black) and ours"))


def build_report(results: pathlib.Path | str, out: pathlib.Path | str,
                 papers: Optional[dict[str, PaperFile]] = None) -> pathlib.Path:
    """Write the site under ``out`` and return the index page's path."""
    results, out = pathlib.Path(results), pathlib.Path(out)
    papers = load_papers() if papers is None else papers
    scanned = scan_records(results)
    skipped: list[Skipped] = list(scanned.skipped)
    if out.exists():  # a rebuilt report never keeps a page or figure of an older one
        for sub in ("records", "fig"):
            shutil.rmtree(out / sub, ignore_errors=True)
        for old in out.glob("*.html"):
            old.unlink()
    (out / "records").mkdir(parents=True, exist_ok=True)

    pages: dict[str, SystemPage] = {name: SystemPage(name, p) for name, p in papers.items()}
    for rec in sorted(scanned.records, key=created_key):
        name = owner(rec)
        page = pages.setdefault(name, SystemPage(name, papers.get(name)))
        href = f"records/{slug(rec['run_id'])}.json"
        (out / href).write_text(json.dumps(rec, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        page.records.append(RecordRow(rec, href, scanned.sources[rec["run_id"]]))
    for page in pages.values():
        page.records.sort(key=lambda r: created_key(r.rec), reverse=True)
        recs = [r.rec for r in page.records]
        if page.paper:
            page.entries = [EntryRow(e, find_ours(e, recs), e.match[0].experiment if e.match else "(no matching experiment in this harness)")
                            for e in page.paper.entries]
        _system_figures(page, out)
        _paper_figures(page, out)

    # Over every record, not one page's: a claim's baseline may be another package's system.
    hinges, hinge_errors = hinge_claims(scanned.records, papers, out)
    for name, found in hinges.items():
        pages[name].hinges = found
    for name, errors in hinge_errors.items():
        pages[name].hinge_errors = errors

    order = [*papers, *sorted(n for n in pages if n not in papers and n != HARNESS),
             *([HARNESS] if HARNESS in pages else [])]
    env = _env()
    common = dict(results=str(results), generated=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                  pages=[pages[n] for n in order])
    shutil.copyfile(pathlib.Path(__file__).with_name("style.css"), out / "style.css")
    for name in order:
        (out / pages[name].href).write_text(env.get_template("system.html.j2").render(page=pages[name], **common),
                                            encoding="utf-8")
    (out / "cross-paper.html").write_text(env.get_template("cross.html.j2").render(
        questions=cross_sections(scanned.records, out), **common), encoding="utf-8")
    index = out / "index.html"
    index.write_text(env.get_template("index.html.j2").render(
        skipped=skipped, n_records=len(scanned.records), paper_scale=paper_scale_rows(), **common), encoding="utf-8")
    return index


def cross_sections(records: list[dict], out: pathlib.Path) -> list[dict]:
    """The cross-paper page (bench.cross): per question its table, refusals and figure."""
    from bench.cross import QUESTIONS, cross_table, plot_cross, table_rows

    sections = []
    for exp, q in QUESTIONS.items():
        t = cross_table(records, exp)
        sec = {"question": q, "slug": slug(exp), "table": None}
        if t is not None and t.rows:
            head, body = table_rows(t)
            fig = f"fig/cross-{slug(exp)}.png"
            plot_cross(t, out / fig)
            sec.update(table=t, head=head, body=body, refusals=t.refusals(), figure=fig)
        sections.append(sec)
    return sections


def paper_scale_rows() -> list[dict]:
    """The fidelity family "paper scale (H100 Megatron)": each shipped profile whose Megatron
    knobs were fitted to measured launches, with its cross-validated errors (derived profiles
    name the profile they come from: not measured on their own GPU)."""
    from impl.common.hardware import hardware_dir, load_hardware

    rows = []
    for path in sorted(hardware_dir().glob("*-megatron.yaml")):
        hw = load_hardware(str(path))
        cal = hw.calibration or {}
        base = cal.get("base_calibration") or cal
        cv = base.get("cross_validated") or {}
        if not cv:
            continue
        pct = lambda k, q: f"{100 * cv[k][q]:.1f}%" if k in cv else "-"  # noqa: E731
        rows.append({"profile": hw.name, "derived_from": cal.get("derived_from"), "runs": base.get("runs_file"),
                     "launches": base.get("launches"), "folds": cv.get("folds"),
                     "pad": f"{pct('pad_time', 'median_abs')} / {pct('pad_time', 'p90_abs')}",
                     "pack": pct("pack_time", "median_abs"), "memory": pct("memory", "median_abs"),
                     "verdict": f"{100 * cv['verdict']['accuracy']:.1f}%" if "verdict" in cv else "-"})
    return rows
