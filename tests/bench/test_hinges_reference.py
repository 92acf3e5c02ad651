"""Each hinge experiment the README reads re-runs, on a reduced range, to the kept records' cells.

The README's "hinges on" column is computed from the kept reference records of the hinge
experiments (bench/data/readme_systems.yaml, ``reference.hinges``). Here one job of each is
re-run in this process (one setting, the low end of the input that moves the first claim most) and
the metric the claim reads must equal the kept record's (sim jobs are bit-reproducible); point 0
must give the README's figure. A change to a pricing path that moves a
hinge cell fails here until the reference is refreshed (``mlsys-bench-readme --refresh``).
"""
from __future__ import annotations

import math
import sys

import pytest

from bench import hinges as hg
from bench import readme_table as rt
from bench.gate import inprocess_runner
from bench.paper import load_papers
from bench.record import scan_records

SPEC = rt.load_spec()
HINGE_EXPERIMENTS = list((SPEC["reference"].get("hinges") or []))  # sim: re-run here
REAL_HINGE_EXPERIMENTS = [e for e in (SPEC["reference"].get("real") or {}) if e.endswith("/hinges")]


@pytest.fixture(scope="module")
def kept():
    return rt.load_reference()


@pytest.fixture(scope="module")
def analysis(kept):
    return hg.analyze(kept, load_papers())


def test_every_kept_hinge_experiment_is_declared_and_analyzed(kept, analysis):
    have = {r["experiment"] for r in kept if ((r.get("config") or {}).get("hinges") or {}).get("point") is not None}
    declared = set(HINGE_EXPERIMENTS) | set(REAL_HINGE_EXPERIMENTS)
    assert all(_declared(e, declared) for e in have), have
    assert all(any(_declared(e, [p]) for e in have) for p in declared), "a declared hinge experiment has no records"
    assert {c.experiment for c in analysis} == have
    for c in analysis:
        assert c.base is not None, f"{c.experiment}: {c.claim}: no figure at point 0"
        assert c.swings and all(len(s.figures) == len(s.values) for s in c.swings)


def test_every_numeric_input_knows_its_composed_value(kept):
    """"Holds at <= / >= v" is read from the as-composed value: a numeric input whose composed config
    holds null (a dataclass default, a carried knob) must declare `composed`."""
    by_exp = {}
    for r in kept:
        if ((r.get("config") or {}).get("hinges") or {}).get("point") is not None:
            by_exp.setdefault(r["experiment"], []).append(r)
    for exp, recs in by_exp.items():
        decl = hg.typed(recs[0]["config"]["hinges"])
        for inp in decl.inputs:
            numeric = inp.factors or all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in inp.values)
            if numeric and not inp.factors and inp.composed is None:
                assert hg._as_composed(recs, inp.key) is not None, f"{exp}: {inp.name}: declare `composed`"


def test_point_zero_gives_the_readme_figure(kept, analysis):
    """The hinge experiment runs the claim's own settings: as composed it is the table's figure."""
    papers = load_papers()
    tol = SPEC["point_tolerance"]
    rows = {(sys_["paper"], entry.name) for sys_, _, entry in rt._entries(SPEC, papers)}
    for c in analysis:
        if (c.paper, c.claim) not in rows:
            continue  # a claim the table has no row for: its reference preset's records are not kept
        entry = papers[c.paper].entry(c.claim)
        mode = "real" if c.experiment in REAL_HINGE_EXPERIMENTS else "sim"
        if mode == "real":
            continue  # a measured figure is not reproduced by a second run: the hinge run is its own
        table = rt.evaluate(entry, kept, tol, {})[mode].ours
        assert table.found and math.isclose(c.base, table.value, rel_tol=1e-9), \
            f"{c.experiment}: {c.claim}: point 0 gives {c.base}, the table {table.value}"


def _declared(experiment: str, presets) -> bool:
    """A record's experiment is a declared preset's (lobra/hinges writes lobra/hinges/e2e_7b, ...)."""
    return any(experiment == p or experiment.startswith(p + "/") for p in presets)


def _replay(rec: dict, decl) -> list[str]:
    """The kept record's overrides without the value its point added (the job adds it again)."""
    k = rec["config"]["hinges"]["point"]
    key = decl.inputs[hg.points(decl)[k - 1][0]].key if k else None
    return [o for o in rec["overrides"] if not (key and o.lstrip("+").split("=", 1)[0] == key)]


def _value(rec: dict, metric: str) -> float:
    return rec["metrics"][metric]["value"]


@pytest.mark.parametrize("preset", HINGE_EXPERIMENTS)
def test_a_reduced_range_reruns_to_the_kept_cells(preset, kept, analysis, tmp_path):
    """The low end of the input that moves the first claim most, in one setting: the re-run
    record's metric equals the kept one (sim jobs are bit-reproducible)."""
    claim = next(c for c in analysis if _declared(c.experiment, [preset]))
    entry = load_papers()[claim.paper].entry(claim.claim)
    m = entry.match[0]
    mine = [r for r in kept if r["experiment"] == claim.experiment and r["status"] == "ok"]
    decl = hg.typed(mine[0]["config"]["hinges"])
    i = next(k for k, inp in enumerate(decl.inputs) if inp.name == claim.swings[0].input.name)
    point = 1 + hg.points(decl).index((i, 0))

    def setting(r):
        return tuple(sorted(o for o in _replay(r, decl) if not o.startswith(("system=", "hinges.point="))))

    by = {(r["system"], setting(r), r["config"]["hinges"]["point"]): r for r in mine if m.metric in r["metrics"]}
    first = sorted(s for (sy, s, p) in by if sy == m.system and p == 0)[0]
    # One job: the claim's system at that point (its baseline where the input is the baseline's
    # own). A LobRA planning job takes ~40 s here; point 0 equals the README's figure by
    # test_point_zero_gives_the_readme_figure, and the gate suites re-run the presets themselves.
    top = decl.inputs[i]
    jobs = [(m.vs if (m.vs and top.systems and m.vs in top.systems) else m.system, point)]
    ran = 0
    for system, p in jobs:
        rec = by.get((system, first, p))
        if rec is None:
            continue
        out = tmp_path / f"{system}-{p}"
        rc, err = inprocess_runner([sys.executable, "-m", "bench", *_replay(rec, decl), f"results_dir={out}"], out)
        assert rc == 0, err
        (got,) = scan_records(out).records
        assert math.isclose(_value(got, m.metric), _value(rec, m.metric), rel_tol=1e-9), \
            f"{claim.experiment} {system} point {p}: {_value(got, m.metric)} != kept {_value(rec, m.metric)}"
        ran += 1
    assert ran == 1
