"""The top-level README's systems table is what `mlsys-bench-readme` writes from the kept
reference records (bench/data/reference_records.jsonl.gz) and impl/*/paper.yaml."""
from __future__ import annotations

import copy

import pytest

from bench import readme_table as rt
from bench.paper import load_papers


@pytest.fixture(scope="module")
def reference():
    return rt.load_reference()


@pytest.fixture(scope="module")
def spec():
    return rt.load_spec()


@pytest.fixture(scope="module")
def papers():
    return load_papers()


def test_readme_table_is_generated(reference, spec, papers):
    """Fails when README.md between the markers differs from what the command writes; fix with
    `mlsys-bench-readme` (or `--refresh` after the presets changed)."""
    want = rt.render_table(rt.split_records(reference)[0], spec, papers, rt.REFERENCE_SOURCE)
    have = rt.section(rt.README_PATH.read_text(encoding="utf-8"))
    assert have == want, "README.md's systems table is stale: run `mlsys-bench-readme`"


def test_check_flag_agrees(capsys):
    assert rt.main(["--check"]) == 0


def test_every_row_names_a_paper_entry_and_the_reference_answers_each_sim_row(reference, spec, papers):
    skipped = spec["reference"]["skipped"]
    for sys_, row, entry in rt._entries(spec, papers):
        cells = rt.evaluate(entry, reference, spec["point_tolerance"], skipped)
        if any(m.mode in (None, "sim") for m in entry.match) and entry.match[0].experiment not in skipped:
            assert cells["sim"].ours.found, f"{sys_['paper']}.{row.entry}: no sim value in the reference records"


def _lobra_7b(records):
    """The 7B LobRA record the table reads (the newest ok one)."""
    exp = [r for r in records if r.get("experiment") == "lobra/e2e_7b" and r["status"] == "ok"]
    return max((r for r in exp if r["system"] == "lobra"), key=rt.created_key)


def test_a_changed_record_changes_the_table(reference, spec, papers):
    before = rt.render_table(reference, spec, papers, rt.REFERENCE_SOURCE)
    changed = copy.deepcopy(reference)
    rec = _lobra_7b(changed)
    entry = papers["lobra"].entry("e2e_7b_vs_task_fused")
    old = rt.evaluate(entry, changed, 0.1, {})["sim"].ours.value
    # Halve LobRA's GPU-seconds: the reduction vs Task-Fused becomes 1 - (1 - old) / 2.
    rec["metrics"]["gpu_seconds"]["value"] /= 2
    new = rt.evaluate(entry, changed, 0.1, {})["sim"].ours.value
    assert new == pytest.approx(1 - (1 - old) / 2)
    after = rt.render_table(changed, spec, papers, rt.REFERENCE_SOURCE)
    assert after != before
    assert rt.value_text(new, "fraction") in after
    # An invalid record is never compared: the row falls back to "no run" with the reason.
    for r in changed:
        if r.get("experiment") == "lobra/e2e_7b" and r["system"] == "lobra":
            r["status"] = "invalid"
    row = next(line for line in rt.render_table(changed, spec, papers).splitlines() if "7B, 16 A100s" in line)
    assert "no run (only" in row and "invalid" in row


def test_state_is_computed(papers):
    e = papers["lobra"].entry("e2e_7b_vs_task_fused")  # band 45.03-60.67%
    assert rt.state_of(0.30, e, 0.1) == "below"
    assert rt.state_of(0.50, e, 0.1) == "in band"
    assert rt.state_of(0.70, e, 0.1) == "above"
    point = papers["adaptra"].entry("s1_adaptra_over_zb")  # 1.76x, +-10%
    assert rt.state_of(1.70, point, 0.1) == "in band"
    assert rt.state_of(1.50, point, 0.1) == "below"


def test_splice_replaces_only_between_the_markers():
    text = f"head\n{rt.BEGIN}\nold table\n{rt.END}\ntail\n"
    out = rt.splice(text, "new table\n")
    assert out == f"head\n{rt.BEGIN}\nnew table\n{rt.END}\ntail\n"
    assert rt.section(out) == "new table\n"
    with pytest.raises(ValueError):
        rt.splice("no markers", "x")


def test_compact_keeps_what_the_matching_reads(tmp_path, reference, spec, papers):
    """Compacting the kept records again changes nothing, and the file is small."""
    assert rt.compact(reference, spec, papers) == reference
    path = tmp_path / "ref.jsonl.gz"
    rt.write_reference(reference, path)
    assert rt.load_reference(path) == reference
    assert rt.REFERENCE_PATH.stat().st_size < 1_000_000


def _rows(reference, spec, papers):
    """(row, entry, the row's markdown cells) in table order."""
    table = rt.render_table(reference, spec, papers, rt.REFERENCE_SOURCE)
    lines = [ln for ln in table.split("\n\n")[0].splitlines()[2:]]
    entries = rt._entries(spec, papers)
    assert len(lines) == len(entries)
    for (sys_, row, entry), line in zip(entries, lines):
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        yield row, entry, cells


def test_every_row_out_of_band_says_what_it_hinges_on(reference, spec, papers):
    for row, entry, cells in _rows(reference, spec, papers):
        state, hinges = cells[5], cells[6]
        if state != "in band":
            assert hinges not in ("", "-"), f"{entry.name}: {state}, but the hinges column is empty"


def test_every_real_row_a_cpu_host_runs_has_a_measured_value(reference, spec, papers):
    real = set(spec["reference"]["real"])
    for row, entry, cells in _rows(reference, spec, papers):
        if any(m.mode == "real" and m.experiment in real for m in entry.match):
            assert "not in the reference set" not in cells[4] + cells[5], entry.name
            assert cells[4] != "-" and "measured on " in cells[4], f"{entry.name}: {cells[4]}"


def test_a_real_value_names_its_host_and_day(reference, spec, papers):
    rec = next(r for r in reference if r.get("mode") == "real" and r["status"] == "ok")
    assert rec["provenance"]["host"]["cpu_count"] and rec["hardware"]


def test_a_refresh_replaces_only_the_presets_it_ran():
    kept = [{"experiment": "a/x", "mode": "sim", "run_id": "1", "created": "2026-01-01"},
            {"experiment": "a/y", "mode": "real", "run_id": "2", "created": "2026-01-01"}]
    new = [{"experiment": "a/x", "mode": "sim", "run_id": "3", "created": "2026-01-02"}]
    assert [r["run_id"] for r in rt.merge_reference(kept, new)] == ["2", "3"]
    new_real = [{"experiment": "a/y", "mode": "real", "run_id": "4", "created": "2026-01-02"}]
    assert [r["run_id"] for r in rt.merge_reference(kept, new_real)] == ["1", "4"]


def test_every_real_preset_composes_with_its_overrides(spec):
    """What `--refresh --real` runs types before it starts (a typo would cost a long run)."""
    from bench.app import preflight

    presets = rt._presets(spec, real=True)
    assert presets and all(m > 0 for _, _, m in presets)
    for name, extra, _ in presets:
        assert preflight(["--multirun", f"experiment={name}", *extra]) is None, name
