"""Each hinge experiment the README reads re-runs, on a reduced range, to the kept records' cells.

The README's "hinges on" column is computed from the kept reference records of the hinge
experiments (bench/data/readme_systems.yaml, ``reference.hinges``). Here one setting of each is
re-run in this process at point 0 (as composed) and at the low end of the input that moves the
first claim most, for the claim's system and its baseline, and every metric the claim reads must
equal the kept record's (sim jobs are bit-reproducible). A change to a pricing path that moves a
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
    assert have == set(HINGE_EXPERIMENTS) | set(REAL_HINGE_EXPERIMENTS)
    assert {c.experiment for c in analysis} == have
    for c in analysis:
        assert c.base is not None, f"{c.experiment}: {c.claim}: no figure at point 0"
        assert c.swings and all(len(s.figures) == len(s.values) for s in c.swings)


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


GROUPS = ("workload", "hardware", "fault")


def _setting(r: dict) -> tuple[str, ...]:
    """The record's group choices (a label's [tweaks] are the point's or the preset's own)."""
    return tuple(str(r.get(g) or "none").split("[")[0] for g in GROUPS)


def _cells(records, metric):
    out = {}
    for r in records:
        if r.get("status") == "ok" and metric in (r.get("metrics") or {}):
            out[(r["system"], *_setting(r), r["config"]["hinges"]["point"])] = r["metrics"][metric]["value"]
    return out


@pytest.mark.parametrize("experiment", HINGE_EXPERIMENTS)
def test_a_reduced_range_reruns_to_the_kept_cells(experiment, kept, analysis, tmp_path):
    claim = next(c for c in analysis if c.experiment == experiment)
    entry = load_papers()[claim.paper].entry(claim.claim)
    m = entry.match[0]
    mine = [r for r in kept if r["experiment"] == experiment]
    decl = hg.typed(mine[0]["config"]["hinges"])
    top = claim.swings[0].input
    i = next(k for k, inp in enumerate(decl.inputs) if inp.name == top.name)
    point = 1 + hg.points(decl).index((i, 0))
    want = _cells(mine, m.metric)
    setting = sorted(k[1:-1] for k in want if k[0] == m.system and k[-1] == 0)[0]
    ran = 0
    for p in (0, point):
        for system in filter(None, (m.system, m.vs)):
            if (system, *setting, p) not in want:
                continue
            choices = [f"{g}={v}" for g, v in zip(GROUPS, setting)]
            rc, err = inprocess_runner([sys.executable, "-m", "bench", f"experiment={experiment}", *choices,
                                        f"system={system}", f"hinges.point={p}", f"results_dir={tmp_path}"],
                                       tmp_path)
            assert rc == 0, err
            ran += 1
    got = _cells(scan_records(tmp_path).records, m.metric)
    assert ran >= 2 and set(got) <= set(want)
    for key, v in got.items():
        assert math.isclose(v, want[key], rel_tol=1e-9), f"{experiment} {key}: {v} != kept {want[key]}"
