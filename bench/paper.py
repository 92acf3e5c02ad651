"""The papers' numbers as data (``impl/<system>/paper.yaml``) and how each finds our value.

A paper file holds the system's title, the paper it reproduces (``paper:``, a citation), the
headline entry and reproduce command, and a list of entries, each one number with its source::

    - name: s1_adaptra_vs_zb            # unique in the file
      value: 1.76                       # the paper's number ...
      high: null                        # ... or the low end of a band [value, high]
      unit: x
      setting: "7B (1,1,4), 30 ms on link 2-3: Adaptra over ZB"
      source: "paper Fig. 9 [P]"       # where: paper <section/figure/table/abstract> | artifact <file>
                                        # | a repository file (a target's README); then its tag
      kind: paper                       # paper (the paper's own number) | target (our [R] bar)
      at_least: false                   # true: a floor ("at least 10x"): in band at or above value
      match:                            # how our records give the number beside it (optional)
        experiment: adaptra/microbench_7b   # fnmatch pattern on the record's experiment
        system: adaptra
        metric: iteration_time_s
        vs: zb                          # ours = times better than zb in the same setting
        form: ratio                     # value | ratio (default with vs) | reduction (1 - 1/ratio)
        mode: null                      # sim | real | null (either)
        where: {workload: gpt7b_pp4, config.fault.delay_s: 0.03}   # dotted paths into the record
        aggregate: null                 # null: one setting (the newest if several) | mean | max | min

``match`` may also be a list of such mappings: the first that finds an ``ok`` record wins (the
default run's ``demo/*`` records and the full preset can both answer one entry). Only
``status: ok`` records are compared; failed and invalid ones are counted and shown as such.
"""
from __future__ import annotations

import fnmatch
import math
import pathlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from bench.compare import GROUP_FIELDS, ratio
from bench.record import created_key
from impl.common.api import ConfigError
from impl.common.systems import paper_file, systems

KINDS = ("paper", "target")
FORMS = ("value", "ratio", "reduction")
AGGREGATES = ("mean", "max", "min")


@dataclass
class Match:
    experiment: str = "???"
    system: str = "???"
    metric: str = "???"
    vs: Optional[str] = None
    form: Optional[str] = None
    mode: Optional[str] = None
    where: Dict[str, Any] = field(default_factory=dict)
    aggregate: Optional[str] = None

    @property
    def resolved_form(self) -> str:
        return self.form or ("ratio" if self.vs else "value")


@dataclass
class PaperEntry:
    name: str = "???"
    value: float = "???"  # type: ignore[assignment]  # '???' = required (OmegaConf MISSING)
    unit: str = "???"
    setting: str = "???"
    source: str = "???"
    high: Optional[float] = None
    kind: str = "paper"
    match: List[Match] = field(default_factory=list)
    # A floor ("at least 10x"): in band at or above value, never above (high must be null).
    at_least: bool = False

    def paper_text(self) -> str:
        unit = "" if self.unit in ("", "x") else f" {self.unit}"
        x = "x" if self.unit == "x" else ""
        if self.at_least:
            return f">= {_num(self.value)}{x}{unit}"
        if self.high is not None:
            return f"{_num(self.value)}-{_num(self.high)}{x}{unit}"
        return f"{_num(self.value)}{x}{unit}"


@dataclass
class PaperFile:
    system: str = "???"
    title: str = "???"
    paper: str = "???"  # the citation: authors, arXiv id or venue
    headline: str = "???"  # name of the entry shown on the index
    reproduce: str = "???"  # the command that reproduces the headline
    entries: List[PaperEntry] = field(default_factory=list)
    path: str = ""  # set by the loader

    def entry(self, name: str) -> PaperEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(name)


def _num(x: float) -> str:
    return f"{x:.4g}"


def load_paper(path: pathlib.Path | str) -> PaperFile:
    """Load and check one paper file; any error is one line naming the file and the field."""
    path = pathlib.Path(path)
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except Exception as exc:  # yaml syntax errors (yaml.YAMLError) and OmegaConf's own
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top, got {type(raw).__name__}")
    entries = raw.pop("entries", None) or []
    if not isinstance(entries, list):
        raise ConfigError(f"{path}: entries: expected a list, got {type(entries).__name__}")
    paper: PaperFile = _typed(PaperFile, raw, path, "")
    for i, entry in enumerate(entries):
        if isinstance(entry, dict) and isinstance(entry.get("match"), dict):
            entry["match"] = [entry["match"]]  # one mapping = a list of one
        elif isinstance(entry, dict) and entry.get("match") is None:
            entry["match"] = []
        # One entry at a time, so that an error names its index.
        paper.entries.append(_typed(PaperEntry, entry, path, f"entries[{i}]"))
    paper.path = str(path)
    _check(paper, path)
    return paper


def _typed(cls, raw: Any, path: pathlib.Path, prefix: str):
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), raw))
    except OmegaConfBaseException as exc:
        key = ".".join(k for k in (prefix, str(getattr(exc, "full_key", "") or "")) if k).replace(".[", "[") or "?"
        msg = str(exc).splitlines()[0].rstrip(".")
        raise ConfigError(f"{path}: {key}: {msg}") from None


def _check(paper: PaperFile, path: pathlib.Path) -> None:
    names = set()
    for i, e in enumerate(paper.entries):
        where = f"{path}: entries[{i}] ({e.name})"
        if e.name in names:
            raise ConfigError(f"{where}.name: duplicate entry name {e.name!r}")
        names.add(e.name)
        if not math.isfinite(e.value):
            raise ConfigError(f"{where}.value: must be a finite number, got {e.value}")
        if e.at_least and e.high is not None:
            raise ConfigError(f"{where}.high: a floor (at_least: true) has no high end")
        if e.high is not None and not e.high >= e.value:
            raise ConfigError(f"{where}.high: {e.high} is below value {e.value} (a band is [value, high])")
        if e.kind not in KINDS:
            raise ConfigError(f"{where}.kind: {e.kind!r} is not one of {', '.join(KINDS)}")
        for j, m in enumerate(e.match):
            mw = f"{where}.match[{j}]"
            if m.form is not None and m.form not in FORMS:
                raise ConfigError(f"{mw}.form: {m.form!r} is not one of {', '.join(FORMS)}")
            if m.form in ("ratio", "reduction") and not m.vs:
                raise ConfigError(f"{mw}.form: {m.form} needs `vs` (the system it is relative to)")
            if m.mode not in (None, "sim", "real"):
                raise ConfigError(f"{mw}.mode: {m.mode!r} is not sim, real or null")
            if m.aggregate not in (None, *AGGREGATES):
                raise ConfigError(f"{mw}.aggregate: {m.aggregate!r} is not one of {', '.join(AGGREGATES)} or null")
    if paper.headline not in names:
        raise ConfigError(f"{path}: headline: {paper.headline!r} is not the name of an entry")


def load_papers(directory: pathlib.Path | str | None = None) -> dict[str, PaperFile]:
    """Every system's ``impl/<system>/paper.yaml``, or every ``<system>.yaml`` under ``directory``."""
    if directory:
        files = [(path.stem, path) for path in sorted(pathlib.Path(directory).glob("*.yaml"))]
    else:
        files = [(name, paper_file(name)) for name in systems() if paper_file(name).is_file()]
    out = {}
    for name, path in files:
        paper = load_paper(path)
        if paper.system != name:
            raise ConfigError(f"{path}: system: {paper.system!r} differs from its system {name!r}")
        out[paper.system] = paper
    return out


# ------------------------------------------------------------------ matching records

@dataclass
class Ours:
    """Our number for one paper entry, or why there is none."""

    value: Optional[float] = None
    mode: Optional[str] = None  # sim | real | "sim+real" (an aggregate over both)
    run_ids: List[str] = field(default_factory=list)  # the records it comes from
    settings: int = 0  # how many matching settings (groups) there were
    note: str = ""  # e.g. "newest of 3 settings", "only invalid runs (2)"
    excluded: Dict[str, int] = field(default_factory=dict)  # failed/invalid records that matched

    @property
    def found(self) -> bool:
        return self.value is not None


def _lookup(record: dict, dotted: str) -> Any:
    node: Any = record
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _selects(m: Match, rec: dict, system: str) -> bool:
    if rec.get("system") != system or not fnmatch.fnmatchcase(str(rec.get("experiment", "")), m.experiment):
        return False
    if m.mode and rec.get("mode") != m.mode:
        return False
    return all(_same(_lookup(rec, k), v) for k, v in m.where.items())


def _group(rec: dict) -> tuple:
    return tuple(rec.get(f) for f in GROUP_FIELDS)


def find_ours(entry: PaperEntry, records: list[dict]) -> Ours:
    """Our value for ``entry``: the first of its ``match`` alternatives that finds ok records."""
    if not entry.match:
        return Ours(note="no matching experiment in this harness")
    misses = []
    for m in entry.match:
        ours = _find_one(m, records)
        if ours.found:
            return ours
        misses.append(ours)
    # None found: say the most telling reason (failed/invalid runs beat "no run yet").
    return next((o for o in misses if o.excluded), misses[0])


def _find_one(m: Match, records: list[dict]) -> Ours:
    mine = [r for r in records if _selects(m, r, m.system)]
    excluded: Dict[str, int] = {}
    for r in mine:
        if r.get("status") != "ok":
            excluded[r["status"]] = excluded.get(r["status"], 0) + 1
    ok = [r for r in mine if r.get("status") == "ok" and m.metric in (r.get("metrics") or {})]
    base: dict[tuple, dict] = {}
    if m.vs:
        for r in sorted((r for r in records if _selects(m, r, m.vs) and r.get("status") == "ok"
                         and m.metric in (r.get("metrics") or {})), key=created_key):
            base[_group(r)] = r  # newest wins
    newest: dict[tuple, dict] = {}
    for r in sorted(ok, key=created_key):
        newest[_group(r)] = r
    values: list[tuple[float, str, list[str], tuple]] = []
    for key, r in newest.items():
        met = r["metrics"][m.metric]
        v = float(met["value"])
        ids = [r["run_id"]]
        if m.vs:
            b = base.get(key)
            if b is None:
                continue
            bm = b["metrics"][m.metric]
            if bm.get("unit") != met.get("unit"):
                continue
            q = ratio(v, float(bm["value"]), bm.get("better", "lower"))
            if q is None:
                continue
            v = q if m.resolved_form == "ratio" else 1.0 - 1.0 / q
            ids.append(b["run_id"])
        values.append((v, r["mode"], ids, key))
    if not values:
        note = "no run yet"
        if excluded:
            note = "only " + ", ".join(f"{n} {s}" for s, n in sorted(excluded.items())) + " run(s)"
        elif ok and m.vs:
            note = f"no ok {m.vs} record in the same setting"
        return Ours(note=note, excluded=excluded)
    modes = sorted({v[1] for v in values})
    mode = modes[0] if len(modes) == 1 else "+".join(modes)
    if m.aggregate:
        nums = [v[0] for v in values]
        agg = {"mean": sum(nums) / len(nums), "max": max(nums), "min": min(nums)}[m.aggregate]
        ids = [i for v in values for i in v[2]]
        return Ours(agg, mode, ids, len(values), f"{m.aggregate} of {len(values)} settings", excluded)
    # Several settings match: the newest is shown and the note says so (a `where` narrows it).
    last = max(values, key=lambda v: created_key(newest[v[3]]))
    note = f"newest of {len(values)} settings" if len(values) > 1 else ""
    return Ours(last[0], last[1], last[2], len(values), note, excluded)
