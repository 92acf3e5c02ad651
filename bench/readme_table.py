"""``mlsys-bench-readme``: the top-level README's systems table and cross-paper figures, written from records.

    mlsys-bench-readme                      # rewrite README.md between the markers from the kept reference records
    mlsys-bench-readme --check              # exit 1 (and print a diff) when README.md differs from that
    mlsys-bench-readme --results DIR --print   # both sections from any results folder, printed only
    mlsys-bench-readme --refresh            # run the reference presets, keep their records, rewrite README.md
    mlsys-bench-readme --refresh --no-run --results DIR   # keep DIR's records as the reference set
    mlsys-bench-readme --refresh --no-run --results DIR --add   # add DIR's records to the kept set
    mlsys-bench-readme --refresh --add --preset cross/varlen    # run one reference preset, add its records
    mlsys-bench-readme --refresh --real     # run the real presets (long, a quiet host), add their records

Added records replace the kept ones of the same (experiment, mode); a full sim refresh replaces every
sim record and keeps the measured ones.

Two sections: the systems table (between ``<!-- systems-table:begin/end -->``, this module) and
the cross-paper figures (between ``<!-- cross-paper:begin/end -->``, :mod:`bench.readme_cross`,
from the records of the cross presets in the reference set).

What the table says comes from three places, none of them hand-written numbers:
``bench/data/readme_systems.yaml`` (each system's name, ``system=`` list, mechanism, which paper
entries get a row, a short label per row, the reference presets), ``impl/<system>/paper.yaml``
(the paper's number or band, via :mod:`bench.paper`) and the records, matched to each entry by
:func:`bench.paper.find_ours`, once restricted to sim records and once to real ones. The state
(in band / below / above / no run / not in the reference set) is computed.

The reference records are ``bench/data/reference_records.jsonl.gz``: the records of the reference
presets, cut down to the fields the matching reads (so the table can be rebuilt, and checked by
``tests/bench/test_readme_table.py``, without running anything); a cross preset's records are cut to
what ``bench/cross.py`` reads (:func:`bench.readme_cross.compact_cross`).

``--add`` merges instead of replacing (:func:`merge_reference`): the added records replace the
kept records of the same experiment and mode (a re-run supersedes the old run), every other kept
record stays. It is how records that the full refresh does not produce (a real run, a single
re-run preset) join the reference set without re-running every preset.
"""
from __future__ import annotations

import argparse
import copy
import difflib
import fnmatch
import gzip
import json
import pathlib
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import yaml

from bench import hinges, readme_cross
from bench.compare import GROUP_FIELDS
from bench.paper import Ours, PaperEntry, PaperFile, find_ours, load_papers
from bench.record import created_key, scan_records

PROG = "mlsys-bench-readme"
BEGIN = "<!-- systems-table:begin -->"
END = "<!-- systems-table:end -->"
DATA = pathlib.Path(__file__).with_name("data")
SPEC_PATH = DATA / "readme_systems.yaml"
REFERENCE_PATH = DATA / "reference_records.jsonl.gz"
REFERENCE_SOURCE = f"the reference records `bench/data/{REFERENCE_PATH.name}`"
REPO = pathlib.Path(__file__).resolve().parent.parent
README_PATH = REPO / "README.md"
MODES = ("sim", "real")
HINGES_SHOWN = 2  # inputs shown per claim in the table (all of them: mlsys-bench-hinges, the report)
# Top-level record fields the matching and the table read; `metrics` is cut to the named metrics.
KEEP = ("schema_version", "run_id", "created", "system", "status", "not_applicable", "invalid_reasons",
        *GROUP_FIELDS)


# ------------------------------------------------------------------ the table's input (readme_systems.yaml)

@dataclass
class TableRow:
    entry: str
    label: str
    # What a row's figure depends on when no hinge experiment sweeps it (a real row: the measured
    # run's own sweep or the host property it hinges on). Words and pointers only, never a figure.
    hinges: str = ""


def load_spec(path: pathlib.Path | str = SPEC_PATH) -> dict:
    spec = yaml.safe_load(pathlib.Path(path).read_text(encoding="utf-8"))
    for sys_ in spec["systems"]:
        sys_["rows"] = [TableRow(**r) for r in sys_["rows"]]
    return spec


def _entries(spec: dict, papers: dict[str, PaperFile]) -> list[tuple[dict, TableRow, PaperEntry]]:
    out = []
    for sys_ in spec["systems"]:
        paper = papers.get(sys_["paper"])
        if paper is None:
            raise SystemExit(f"{PROG}: {SPEC_PATH.name}: no impl/{sys_['paper']}/paper.yaml")
        for row in sys_["rows"]:
            try:
                out.append((sys_, row, paper.entry(row.entry)))
            except KeyError:
                raise SystemExit(f"{PROG}: {SPEC_PATH.name}: {sys_['paper']}: no entry {row.entry!r} "
                                 f"in {paper.path}") from None
    return out


# ------------------------------------------------------------------ records

def load_reference(path: pathlib.Path | str = REFERENCE_PATH) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def load_results(results: pathlib.Path | str) -> list[dict]:
    return list(scan_records(results).records)


def _wanted(spec: dict, papers: dict[str, PaperFile]) -> tuple[list, dict[str, set], set]:
    """(the matches the table reads, metric names per system, dotted `where` paths)."""
    matches, metrics, paths = [], {}, set()
    for _, _, entry in _entries(spec, papers):
        for m in entry.match:
            matches.append(m)
            for s in (m.system, m.vs):
                if s:
                    metrics.setdefault(s, set()).add(m.metric)
            paths.update(m.where)
    return matches, metrics, paths


def _lookup(rec: dict, dotted: str) -> tuple[bool, Any]:
    node: Any = rec
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _put(out: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for part in parts[:-1]:
        out = out.setdefault(part, {})
    out[parts[-1]] = value


def _hinge_wanted(rec: dict, papers: dict[str, PaperFile]) -> Optional[tuple[set, set]]:
    """(metric names, dotted config paths) a hinge record's claims read; None if not a hinge record."""
    h = (rec.get("config") or {}).get("hinges")
    if not isinstance(h, dict) or h.get("point") is None or h.get("paper") not in papers:
        return None
    paper = papers[h["paper"]]
    metrics, paths = set(), {"config.hinges"}
    for claim in h.get("claims") or []:
        try:
            entry = paper.entry(claim)
        except KeyError:
            continue
        for m in entry.match:
            if rec.get("system") in (m.system, m.vs):
                metrics.add(m.metric)
            paths.update(m.where)
    paths.update(f"config.{i['key']}" for i in h.get("inputs") or [] if i.get("key"))
    return metrics, paths


def compact(records: list[dict], spec: dict, papers: dict[str, PaperFile]) -> list[dict]:
    """The records some row's match (or a hinge experiment's claim) selects, each cut to the fields
    the table reads, and the cross questions' records, each cut to the fields the cross section reads."""
    matches, metrics, paths = _wanted(spec, papers)
    out = []
    for rec in sorted(records, key=created_key):
        if readme_cross.is_cross(rec):
            out.append(readme_cross.compact_cross(rec))
            continue
        hinge = _hinge_wanted(rec, papers)
        sel = [m for m in matches if rec.get("system") in (m.system, m.vs)
               and fnmatch.fnmatchcase(str(rec.get("experiment", "")), m.experiment)]
        if not sel and not (hinge and hinge[0]):
            continue
        small = {k: rec[k] for k in KEEP if k in rec}
        names = metrics.get(rec["system"], set()) | (hinge[0] if hinge else set())
        rec_paths = paths | (hinge[1] if hinge else set())
        small["metrics"] = {n: {k: v for k, v in met.items() if k in ("value", "unit", "better")}
                            for n, met in sorted((rec.get("metrics") or {}).items()) if n in names}
        for dotted in sorted(rec_paths):
            found, value = _lookup(rec, dotted)
            if found:
                _put(small, dotted, value)
        if hinge:  # what re-runs the record (tests/bench/test_hinges_reference.py replays a few)
            small["overrides"] = [o for o in rec.get("overrides") or [] if not o.startswith(("results_dir=", "progress="))]
        git = ((rec.get("provenance") or {}).get("git") or {})
        small["provenance"] = {"git": {k: git.get(k) for k in ("commit", "dirty")}}
        if rec.get("mode") == "real":  # a measured figure names the host it was measured on
            host = (rec.get("provenance") or {}).get("host") or {}
            small["provenance"]["host"] = {k: host.get(k) for k in ("hostname", "cpu_count")}
            small["host_load"] = {k: (rec.get("host_load") or {}).get(k) for k in ("foreign_cpu_frac",)}
        out.append(small)
    return out


def merge_reference(kept: list[dict], added: list[dict]) -> list[dict]:
    """``kept`` with ``added`` in it: the added records replace every kept record of the same
    (experiment, mode), so a re-run supersedes the old one and the file does not grow."""
    replaced = {(r.get("experiment"), r.get("mode")) for r in added}
    new_ids = {r.get("run_id") for r in added}
    out = [r for r in kept if (r.get("experiment"), r.get("mode")) not in replaced and r.get("run_id") not in new_ids]
    return sorted(out + list(added), key=created_key)


def write_reference(records: list[dict], path: pathlib.Path | str = REFERENCE_PATH) -> None:
    text = "".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in records)
    # mtime=0: the same records give the same bytes (no spurious diffs in git).
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as fh:
        fh.write(text.encode("utf-8"))


# ------------------------------------------------------------------ the table

def _num(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def value_text(v: float, unit: str) -> str:
    if unit == "fraction":
        return f"{_num(100 * v)}%"
    if unit == "x":
        return f"{_num(v)}x"
    return f"{_num(v)} {unit}" if unit else _num(v)


def claim_text(e: PaperEntry) -> str:
    if e.at_least:
        return ">= " + value_text(e.value, e.unit)
    if e.high is None:
        return value_text(e.value, e.unit)
    if e.unit == "fraction":
        return f"{100 * e.value:.4g}-{100 * e.high:.4g}%"
    return f"{e.value:.4g}-{value_text(e.high, e.unit)}"


def band(e: PaperEntry, tol: float) -> tuple[float, float]:
    if e.at_least:
        return e.value, float("inf")
    if e.high is not None:
        return e.value, e.high
    lo, hi = e.value * (1 - tol), e.value * (1 + tol)
    return min(lo, hi), max(lo, hi)


def state_of(v: float, e: PaperEntry, tol: float) -> str:
    lo, hi = band(e, tol)
    return "in band" if lo <= v <= hi else ("below" if v < lo else "above")


def _restricted(entry: PaperEntry, mode: str) -> Optional[PaperEntry]:
    """The entry with every match narrowed to ``mode``; None when no match can give that mode."""
    e = copy.deepcopy(entry)
    e.match = [m for m in e.match if m.mode in (None, mode)]
    if not e.match:
        return None
    for m in e.match:
        m.mode = mode
    return e


def _skipped_reason(entry: PaperEntry, skipped: dict[str, str], mode: Optional[str]) -> Optional[str]:
    """Why no record can answer ``entry`` (in ``mode``): every match is a preset left out."""
    ms = [m for m in entry.match if mode is None or m.mode in (None, mode)]
    reasons = [skipped[m.experiment] for m in ms if m.experiment in skipped]
    return reasons[0] if ms and len(reasons) == len(ms) else None


@dataclass
class TableCell:
    ours: Optional[Ours]  # None: this mode cannot answer the entry
    state: str  # "" when no value


def evaluate(entry: PaperEntry, records: list[dict], tol: float, skipped: dict[str, str]) -> dict[str, TableCell]:
    cells = {}
    for mode in MODES:
        e = _restricted(entry, mode)
        if e is None:
            cells[mode] = TableCell(None, "")
            continue
        ours = find_ours(e, records)
        cells[mode] = TableCell(ours, state_of(ours.value, entry, tol) if ours.found else "")
    return cells


def _measured_where(cell: TableCell, records: list[dict]) -> str:
    """``measured on <hardware>, <date>`` of the records a real value comes from."""
    ids = set(cell.ours.run_ids)
    recs = [r for r in records if r.get("run_id") in ids]
    hw = sorted({str(r.get("hardware") or "?") for r in recs})
    days = sorted({str(r.get("created", ""))[:10] for r in recs if r.get("created")})
    when = days[0] if len(days) == 1 else (f"{days[0]} to {days[-1]}" if days else "no date")
    return f"measured on {', '.join(hw) or '?'}, {when}"


def _ours_text(cell: TableCell, entry: PaperEntry, records: Optional[list[dict]] = None) -> str:
    if cell.ours is None or not cell.ours.found:
        return "-"
    notes = [cell.ours.note] if cell.ours.note else []
    if records is not None and cell.ours.mode == "real":
        notes.append(_measured_where(cell, records))
    note = f" ({'; '.join(notes)})" if notes else ""
    return value_text(cell.ours.value, entry.unit) + note


def _state_text(cells: dict[str, TableCell], entry: PaperEntry, skipped: dict[str, str]) -> str:
    got = [(m, c) for m, c in cells.items() if c.state]
    if len(got) == 1:
        return got[0][1].state
    if got:
        return "; ".join(f"{m} {c.state}" for m, c in got)
    if not entry.match:
        return "no run (no matching experiment in this harness)"
    reason = _skipped_reason(entry, skipped, None)
    if reason:
        return f"not in the reference set ({reason})"
    notes = sorted({c.ours.note for c in cells.values() if c.ours is not None and c.ours.note})
    excluded = [n for n in notes if n.startswith("only ")]
    return "no run" + (f" ({excluded[0]})" if excluded else "")


def _hinges_text(ch, entry: PaperEntry, row: "TableRow") -> str:
    """The inputs that move the claim most (from its hinge experiment's records), else the row's
    declared pointer (a real row: what its measurement depends on and the sweep that shows it)."""
    if ch is not None:
        unit = "%" if entry.unit == "fraction" else "x"
        return f"{hinges.claim_text(ch, unit, top=HINGES_SHOWN)} (`experiment={ch.experiment}`)"
    return row.hinges or "-"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _systems_cell(sys_: dict) -> str:
    return f"{sys_['name']}: {sys_['systems']}"


def analyze_hinges(records: list[dict], papers: dict[str, PaperFile]) -> list:
    return hinges.analyze(records, papers)


def render_table(records: list[dict], spec: Optional[dict] = None,
                 papers: Optional[dict[str, PaperFile]] = None, source: str = "") -> str:
    """The markdown between the markers (without them)."""
    spec = load_spec() if spec is None else spec
    papers = load_papers() if papers is None else papers
    tol = float(spec.get("point_tolerance", 0.1))
    skipped = dict((spec.get("reference") or {}).get("skipped") or {})
    lines = ["| system (`system=`) | paper mechanism | paper claim (setting) | ours, sim | ours, real | state "
             "| hinges on |",
             "|---|---|---|---|---|---|---|"]
    found = {(c.paper, c.claim): c for c in analyze_hinges(records, papers)}
    for sys_, row, entry in _entries(spec, papers):
        first = row is sys_["rows"][0]
        cells = evaluate(entry, records, tol, skipped)
        kind = "our target [R]: " if entry.kind == "target" else ""
        claim = f"{claim_text(entry)} ({kind}{row.label})"
        sim, real = (_ours_text(cells[m], entry, records) for m in MODES)
        for mode, text in (("sim", sim), ("real", real)):
            if text == "-" and cells[mode].ours is not None:
                reason = _skipped_reason(entry, skipped, mode)
                if reason:
                    text = "not in the reference set"
                if mode == "sim":
                    sim = text
                else:
                    real = text
        system = _systems_cell(sys_) if first else ""
        mech = f"{sys_['mechanism']}; {sys_['runs']}; [{sys_['readme']}]({sys_['readme']})" if first else ""
        lines.append("| " + " | ".join(_cell(t) for t in (system, mech, claim, sim, real,
                                                            _state_text(cells, entry, skipped),
                                                            _hinges_text(found.get((sys_["paper"], entry.name)),
                                                                         entry, row))) + " |")
    lines += ["", "| harness tool | what | how |", "|---|---|---|"]
    for tool in spec.get("tools") or []:
        how = tool["how"]
        if tool.get("figures") == "paper_scale":
            how += _paper_scale_text()
        lines.append("| " + " | ".join(_cell(t) for t in (tool["name"], tool["what"], how)) + " |")
    commits = sorted({str(((r.get("provenance") or {}).get("git") or {}).get("commit") or "?")[:10] for r in records})
    dates = sorted(str(r.get("created", ""))[:10] for r in records if r.get("created"))
    span = (dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}") if dates else "no dates"
    lines += ["", f"Written by `mlsys-bench-readme` from {source or 'the records given'} ({len(records)} records, "
              f"{span}, commit {', '.join(commits) or '-'}) and `impl/*/paper.yaml`; do not edit between the "
              f"markers. A band is the paper's (or our reconstructed target [R]); a single number counts as in band "
              f"within ±{100 * tol:.0f}%, a floor (>=) at or above it. Ours is the newest ok record of the same setting; failed and invalid "
              f"runs are never compared. Refresh: `mlsys-bench-readme --refresh` (runs the reference presets)."]
    return "\n".join(lines) + "\n"


def _paper_scale_text() -> str:
    """The cross-validated errors of each fitted (not derived) Megatron profile."""
    from impl.common.hardware import hardware_dir, load_hardware

    parts = []
    for path in sorted(hardware_dir().glob("*-megatron.yaml")):
        cal = load_hardware(str(path)).calibration or {}
        if cal.get("derived_from") or not cal.get("cross_validated"):
            continue
        cv = cal["cross_validated"]
        pct = lambda k, q: f"{100 * cv[k][q]:.1f}%" if k in cv else "-"  # noqa: E731
        launches = cal.get('launches')
        text = (f"`{path.stem}`: {f'{launches:,}' if isinstance(launches, int) else '?'} launches, {cv.get('folds', '?')}-fold: pad time "
                f"{pct('pad_time', 'median_abs')} median / {pct('pad_time', 'p90_abs')} p90, pack "
                f"{pct('pack_time', 'median_abs')}, memory {pct('memory', 'median_abs')}")
        if "verdict" in cv:
            text += f", fit verdict {100 * cv['verdict']['accuracy']:.1f}%"
        parts.append(text)
    return (" (" + "; ".join(parts) + ")") if parts else ""


# ------------------------------------------------------------------ the README

def _bounds(readme: str, begin: str, end: str) -> tuple[int, int]:
    b, e = readme.find(begin), readme.find(end)
    if b < 0 or e < 0 or e < b:
        raise ValueError(f"README has no {begin} ... {end} section")
    return b, e


def splice(readme: str, table: str, begin: str = BEGIN, end: str = END) -> str:
    """``readme`` with the text between the markers replaced by ``table``."""
    b, e = _bounds(readme, begin, end)
    return readme[: b + len(begin)] + "\n" + table + readme[e:]


def section(readme: str, begin: str = BEGIN, end: str = END) -> str:
    b, e = _bounds(readme, begin, end)
    return readme[b + len(begin): e].lstrip("\n")


def split_records(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the records the systems table reads, the cross questions' records)."""
    return ([r for r in records if not readme_cross.is_cross(r)], [r for r in records if readme_cross.is_cross(r)])


def render_readme(readme: str, records: list[dict], spec: dict, papers: dict[str, PaperFile], source: str) -> str:
    """``readme`` with both generated sections rewritten from ``records``."""
    table_recs, cross_recs = split_records(records)
    out = splice(readme, render_table(table_recs, spec, papers, source))
    return splice(out, readme_cross.render_cross(cross_recs, spec, source), readme_cross.BEGIN, readme_cross.END)


def _presets(spec: dict, real: bool) -> list[tuple[str, list[str], float]]:
    """(preset, extra overrides, minutes expected) of what ``--refresh`` (sim) or ``--refresh --real`` runs."""
    ref = spec["reference"]
    if real:
        return [(name, list(r.get("overrides") or []), float(r.get("minutes") or 1.0))
                for name, r in (ref.get("real") or {}).items()]
    sim = list(ref["presets"]) + list(ref.get("hinges") or [])
    return [(name, [], 1.0) for name in sim]


def refresh(results: Optional[pathlib.Path], run: bool, spec: dict, real: bool = False,
            only: Optional[Sequence[str]] = None) -> pathlib.Path:
    from tqdm import tqdm

    results = results or pathlib.Path(tempfile.mkdtemp(prefix="mlsys-readme-"))
    if not run:
        return results
    presets = [p for p in _presets(spec, real) if not only or p[0] in only]
    total = sum(m for _, _, m in presets)
    if real:
        print(f"{PROG}: {len(presets)} real presets, about {total:.0f} minutes on a quiet 2-core host; "
              "run nothing else meanwhile (a contended run is recorded invalid and never compared)", flush=True)
    bar = tqdm(total=round(total, 1), desc=PROG, unit="min" if real else "preset", disable=not sys.stderr.isatty())
    for preset, extra, minutes in presets:
        cmd = [sys.executable, "-m", "bench", "--multirun", f"experiment={preset}", *extra, f"results_dir={results}"]
        bar.write(f"{PROG}: {' '.join(cmd)}")
        done = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode:
            tail = (done.stderr or "").strip().splitlines()[-1:] or ["?"]
            bar.write(f"{PROG}: warning: {preset} exited {done.returncode}: {tail[0]}")
        bar.update(minutes)
    bar.close()
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--results", help="a results folder to read instead of the kept reference records")
    p.add_argument("--readme", default=str(README_PATH), help="the README to rewrite (default %(default)s)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when the README differs")
    p.add_argument("--print", dest="print_only", action="store_true", help="print both sections, write nothing")
    p.add_argument("--refresh", action="store_true",
                   help="run the reference presets into --results (default: a new temp folder), keep their "
                        f"records as {REFERENCE_PATH.name}, then rewrite the README")
    p.add_argument("--no-run", action="store_true", help="with --refresh: keep --results' records, run nothing")
    p.add_argument("--real", action="store_true",
                   help="with --refresh: run the real presets (reference.real: long, needs a quiet host) and add "
                        "their records (implies --add)")
    p.add_argument("--add", action="store_true",
                   help="with --refresh: add the records to the kept set (replacing the kept records of the same "
                        "experiment and mode) instead of replacing every sim record")
    p.add_argument("--preset", action="append", default=[],
                   help="with --refresh --add: run only this reference preset (repeatable)")
    args = p.parse_args(argv)
    spec, papers = load_spec(), load_papers()
    if (args.add or args.preset or args.real) and not args.refresh:
        p.error("--add, --preset and --real go with --refresh")
    if args.preset and not (args.add or args.real):
        p.error("--preset needs --add (the other presets' kept records would be dropped)")
    known = [name for real in (False, True) for name, _, _ in _presets(spec, real)]
    unknown = [x for x in args.preset if x not in known]
    if unknown:
        p.error(f"--preset {unknown[0]}: not a reference preset of {SPEC_PATH.name}")
    if args.refresh:
        if args.no_run and not args.results:
            p.error("--refresh --no-run needs --results DIR")
        if args.no_run and not pathlib.Path(args.results).is_dir():
            p.error(f"--results {args.results}: no such folder")
        results = refresh(pathlib.Path(args.results) if args.results else None, not args.no_run, spec, args.real,
                          args.preset)
        kept = compact(load_results(results), spec, papers)
        before = load_reference(REFERENCE_PATH) if REFERENCE_PATH.exists() else []
        if args.add or args.real:
            kept, added = merge_reference(before, kept), len(kept)
            print(f"{PROG}: added {added} records from {results} to the {len(before)} kept ({len(kept)} now)")
        else:  # every sim record is replaced; the measured ones (--refresh --real) stay
            kept = merge_reference([r for r in before if r.get("mode") == "real"], kept)
        write_reference(kept, REFERENCE_PATH)
        print(f"{PROG}: kept {len(kept)} records from {results} in {REFERENCE_PATH}")
        records, source = kept, REFERENCE_SOURCE
    elif args.results:
        if not pathlib.Path(args.results).is_dir():
            print(f"{PROG}: results dir {args.results} does not exist", file=sys.stderr)
            return 2
        records, source = load_results(args.results), f"the records in `{args.results}`"
    else:
        records, source = load_reference(REFERENCE_PATH), REFERENCE_SOURCE
    if args.print_only:
        table_recs, cross_recs = split_records(records)
        sys.stdout.write(render_table(table_recs, spec, papers, source) + "\n"
                         + readme_cross.render_cross(cross_recs, spec, source))
        return 0
    readme = pathlib.Path(args.readme)
    old = readme.read_text(encoding="utf-8")
    try:
        new = render_readme(old, records, spec, papers, source)
    except ValueError as exc:
        print(f"{PROG}: {readme}: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if new == old:
            return 0
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                   str(readme), f"{readme} (written by {PROG})"))
        return 1
    if new != old:
        readme.write_text(new, encoding="utf-8")
    print(f"{PROG}: {readme}: systems table and cross-paper figures written from {len(records)} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
