"""The top-level README's cross-paper figures are what `mlsys-bench-readme` writes from the kept
cross records (bench/readme_cross.py through bench/cross.py); `--add` merges records into the kept set."""
from __future__ import annotations

import copy

import pytest

from bench import readme_cross as rc
from bench import readme_table as rt
from bench.cross import QUESTIONS, cross_table


@pytest.fixture(scope="module")
def reference():
    return rt.load_reference()


@pytest.fixture(scope="module")
def cross(reference):
    return rt.split_records(reference)[1]


@pytest.fixture(scope="module")
def spec():
    return rt.load_spec()


def test_readme_cross_section_is_generated(cross, spec):
    """Fails when README.md between the cross-paper markers differs from what the kept records give;
    fix with `mlsys-bench-readme` (or `--refresh --add --preset cross/<name>` after a preset changed)."""
    want = rc.render_cross(cross, spec, rt.REFERENCE_SOURCE)
    have = rt.section(rt.README_PATH.read_text(encoding="utf-8"), rc.BEGIN, rc.END)
    assert have == want, "README.md's cross-paper figures are stale: run `mlsys-bench-readme`"


def test_the_reference_answers_every_cross_preset(cross, spec):
    presets = [p for p in spec["reference"]["presets"] if p in QUESTIONS]
    assert {"cross/stragglers", "cross/gpu_loss", "cross/varlen"} <= set(presets)
    for exp in presets:
        t = cross_table(cross, exp)
        assert t.rows, f"{exp}: no records in the reference set"
        for sit in t.rows:
            assert t.winner(sit)[0] is not None, f"{exp} {sit}: no ok record"


def _row(text: str, title: str, situation: str) -> list[str]:
    """The cells of one situation's row in one question's table."""
    block = text[text.index(title):]
    line = next(ln for ln in block.splitlines() if ln.startswith(f"| {situation} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_a_changed_record_changes_the_winner(cross, spec):
    t = cross_table(cross, "cross/stragglers")
    sit = next(s for s in t.rows if t.winner(s)[2] is not None and t.winner(s)[1] > 1.0)
    best, _, runner = t.winner(sit)
    before = rc.render_cross(cross, spec)
    assert _row(before, t.question.title, rc._situation(t, sit))[-2] == f"`{best}`"
    changed = copy.deepcopy(cross)
    rec = max((r for r in changed if r["experiment"] == "cross/stragglers" and r["fault"] == sit
               and r["system"] == best), key=rt.created_key)
    # The winner becomes 10x slower than the runner-up: the runner-up wins that row.
    rec["metrics"]["iteration_time_s"]["value"] = 10 * t.rows[sit][runner].value
    after = rc.render_cross(changed, spec)
    assert after != before
    assert _row(after, t.question.title, rc._situation(t, sit))[-2] == f"`{runner}`"


def test_refusals_are_listed_with_their_line(cross, spec):
    text = " ".join(rc.render_cross(cross, spec).split())  # a line may wrap
    refused = [r for r in cross if r.get("not_applicable")]
    assert refused, "the cross presets have refusals (Malleus on a slow link, megatron_grid on a token budget)"
    for r in refused:
        assert f"`{r['system']}` on " in text and r["error"] in text
    changed = copy.deepcopy(cross)
    for r in changed:
        if r.get("not_applicable"):
            r["error"] = "fault.kind: a different reason"
    assert "fault.kind: a different reason" in rc.render_cross(changed, spec)


def _full(system, fault, value, run_id, created="2027-01-01T00:00:00+00:00", **more):
    """A cross record with fields the cross table never reads."""
    rec = {"schema": "x", "run_id": run_id, "created": created, "status": "ok", "error": None,
           "invalid_reasons": [], "experiment": "cross/stragglers", "system": system, "mode": "sim",
           "workload": "w", "hardware": "h", "fault": fault, "seed": 0,
           "metrics": {"iteration_time_s": {"value": value, "unit": "s", "better": "lower", "extra": 1},
                       "other_metric": {"value": 1.0, "unit": "s"}},
           "provenance": {"git": {"commit": "abc", "dirty": False, "branch": "b"}, "host": "x"},
           "config": {"big": list(range(10))}, "info": {"note": "x"}, "overrides": ["a=b"]}
    rec.update(more)
    return rec


def test_compact_cross_keeps_what_the_cross_table_reads(spec):
    full = [_full("zb", "none", 2.0, "r1"), _full("adaptra", "none", 1.0, "r2"),
            _full("malleus", "link", 0.0, "r3", status="failed", error="fault.kind: no", not_applicable=True,
                  metrics={})]
    small = [rc.compact_cross(r) for r in full]
    assert rc.render_cross(small, spec) == rc.render_cross(full, spec)
    assert all("config" not in r and "other_metric" not in r["metrics"] for r in small)
    assert [rc.compact_cross(r) for r in small] == small


def test_merge_replaces_the_same_experiment_and_mode_only():
    kept = [{"run_id": "a", "created": "2026-01-01", "experiment": "e1", "mode": "sim"},
            {"run_id": "b", "created": "2026-01-01", "experiment": "e2", "mode": "sim"},
            {"run_id": "c", "created": "2026-01-01", "experiment": "e2", "mode": "real"}]
    added = [{"run_id": "d", "created": "2026-02-01", "experiment": "e2", "mode": "sim"},
             {"run_id": "e", "created": "2026-02-01", "experiment": "e3", "mode": "sim"}]
    assert [r["run_id"] for r in rt.merge_reference(kept, added)] == ["a", "c", "d", "e"]


def test_add_merges_into_the_kept_set(tmp_path, monkeypatch, reference):
    """--refresh --no-run --results DIR --add: DIR's cross records replace the kept ones of that
    experiment, every other kept record stays, and the README is rewritten from the merged set."""
    ref = tmp_path / "ref.jsonl.gz"
    rt.write_reference(reference, ref)
    readme = tmp_path / "README.md"
    readme.write_text(rt.README_PATH.read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "runs").mkdir()
    new = [_full("adaptra", "none", 1.25, "n1"), _full("zb", "none", 5.0, "n2")]
    monkeypatch.setattr(rt, "REFERENCE_PATH", ref)
    monkeypatch.setattr(rt, "load_results", lambda _: new)
    assert rt.main(["--refresh", "--no-run", "--results", str(tmp_path / "runs"), "--add",
                    "--readme", str(readme)]) == 0
    merged = rt.load_reference(ref)
    others = [r for r in reference if r.get("experiment") != "cross/stragglers"]
    assert [r for r in merged if r.get("experiment") != "cross/stragglers"] == others
    assert sorted(r["run_id"] for r in merged if r.get("experiment") == "cross/stragglers") == ["n1", "n2"]
    text = readme.read_text(encoding="utf-8")
    assert rt.section(text) == rt.section(rt.README_PATH.read_text(encoding="utf-8"))  # systems table unchanged
    row = _row(rt.section(text, rc.BEGIN, rc.END), QUESTIONS["cross/stragglers"].title, "none (no fault)")
    assert row[1:3] == ["1.25", "5"] and row[-1] == "4.00x over `zb` (5)"
