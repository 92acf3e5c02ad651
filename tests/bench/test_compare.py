"""bench.compare: grouping, the ratio convention, exclusions, labels, report files, errors."""
from __future__ import annotations

import math

import pytest

from bench import compare
from bench.compare import GroupKey, compare_records, format_table, ratio
from bench.record import load_records, write_record

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def metric(value, unit="s", better="lower", n=1, p10=None, p90=None):
    return {"value": value, "unit": unit, "better": better, "n": n, "p50": value,
            "p10": value if p10 is None else p10, "p90": value if p90 is None else p90}


def record(run_id, system, metrics=None, *, status="ok", mode="sim", experiment="exp",
           workload="w", hardware="h", fault="none", created="2026-01-01T00:00:00+00:00", **extra):
    rec = {"schema": "mlsys-bench.record/1", "run_id": run_id, "created": created,
           "status": status, "error": None if status == "ok" else "job crashed: boom",
           "experiment": experiment, "system": system, "mode": mode, "workload": workload,
           "hardware": hardware, "fault": fault, "seed": 0, "metrics": metrics or {},
           "provenance": {"git": {"commit": None, "dirty": None}, "packages": {}, "host": {},
                          "devices": [], "container_image": None, "emulated": []},
           "config": {}, "overrides": [], "wandb": None}
    rec.update(extra)
    return rec


@pytest.fixture
def results(tmp_path):
    d = tmp_path / "runs"
    for rec in [
        record("r1", "zb", {"time": metric(2.0), "tput": metric(100.0, "tok/s", "higher")}),
        record("r2", "adaptra", {"time": metric(1.0), "tput": metric(150.0, "tok/s", "higher")}),
        record("r3", "1f1b", {}, status="failed"),
        record("r4", "adaptra", {"time": metric(0.1)}, status="invalid",
               invalid_reasons=["too few iterations"]),
        record("r5", "zb", {"time": metric(3.0, n=5, p10=2.5, p90=3.5)}, mode="real"),
        record("r6", "adaptra", {"time": metric(2.0, n=5, p10=1.8, p90=2.2)}, mode="real"),
    ]:
        write_record(d, rec)
    return d


def by_system(table):
    return {row.system: row for row in table.rows}


# ------------------------------------------------------------------ ratios and grouping

@pytest.mark.parametrize("cand,base,better,expected", [
    (1.0, 2.0, "lower", 2.0),     # half the time: 2x better
    (4.0, 2.0, "lower", 0.5),
    (150.0, 100.0, "higher", 1.5),  # 1.5x the throughput: 1.5x better
    (50.0, 100.0, "higher", 0.5),
    (0.0, 2.0, "lower", None),
    (0.0, 0.0, "lower", 1.0),
    (0.03, 0.0, "lower", None),   # a stall share against a stall-free baseline: no "0.00x"
    (0.0, 5.0, "higher", None),
    (-1.0, 2.0, "lower", None),
])
def test_ratio_is_times_better_in_both_directions(cand, base, better, expected):
    assert ratio(cand, base, better) == expected


def test_groups_by_experiment_workload_hardware_fault_mode():
    recs = [record(f"r{i}", "a", {"t": metric(1.0)}, **{field: value})
            for i, (field, value) in enumerate([("experiment", "e2"), ("workload", "w2"),
                                                ("hardware", "h2"), ("fault", "f2"),
                                                ("mode", "real")])]
    recs.append(record("base", "a", {"t": metric(1.0)}))
    recs.append(record("same-group", "b", {"t": metric(1.0)}))
    tables = compare_records(recs)
    assert len(tables) == 6
    main = [t for t in tables if t.key == GroupKey("exp", "w", "h", "none", "sim")]
    assert [r.system for r in main[0].rows] == ["a", "b"]


def test_baseline_ratios_and_exclusions(results):
    from bench.record import load_records

    tables = compare_records(load_records(results), baseline="zb")
    sim = next(t for t in tables if t.key.mode == "sim")
    rows = by_system(sim)
    assert sim.rows[0].system == "zb"  # the baseline row comes first
    assert rows["adaptra"].cells["time"].ratio == pytest.approx(2.0)
    assert rows["adaptra"].cells["tput"].ratio == pytest.approx(1.5)
    assert rows["zb"].cells["time"].ratio == 1.0
    assert "1f1b" not in rows  # failed: excluded ...
    assert sim.excluded == {"failed": 1, "invalid": 1}  # ... and counted, as is the invalid one
    assert rows["adaptra"].cells["time"].value == 1.0  # not the invalid record's 0.1
    text = format_table(sim)
    assert "x = times better than zb" in text
    assert "excluded: 1 failed, 1 invalid" in text


def test_newest_ok_record_per_system_is_shown():
    recs = [record("old", "a", {"t": metric(5.0)}, created="2026-01-01T00:00:00+00:00"),
            record("new", "a", {"t": metric(1.0)}, created="2026-01-02T00:00:00Z"),
            record("b", "b", {"t": metric(2.0)})]
    (table,) = compare_records(recs, baseline="b")
    row = by_system(table)["a"]
    assert (row.run_id, row.superseded, row.cells["t"].ratio) == ("new", 1, 2.0)
    assert "a: newest of 2 ok records shown (new)" in format_table(table)


def test_default_baseline_is_first_alphabetically_and_said_so():
    recs = [record("1", "zeta", {"t": metric(1.0)}), record("2", "alpha", {"t": metric(2.0)})]
    (table,) = compare_records(recs)
    assert table.baseline == "alpha"
    assert by_system(table)["zeta"].cells["t"].ratio == 2.0
    assert "first system alphabetically" in format_table(table)


def test_missing_baseline_is_a_note_not_a_crash():
    recs = [record("1", "a", {"t": metric(1.0)}), record("2", "b", {"t": metric(2.0)})]
    (table,) = compare_records(recs, baseline="zb")
    assert not table.baseline_present
    assert all(c.ratio is None for r in table.rows for c in r.cells.values())
    text = format_table(table)
    assert "baseline 'zb' has no ok record in this group" in text
    assert "times better" not in text and " x" not in text.splitlines()[-3]  # no ratio column


def test_group_without_baseline_has_no_ratio_column_and_no_noise():
    # The default run's calibration job: one system, never run with the plan's baseline.
    (table,) = compare_records([record("1", "calibrate", {"t": metric(1.0)})], baseline="zb")
    text = format_table(table)
    assert "zb" not in text and "times better" not in text
    head = text.splitlines()[-3]
    assert head.split()[-1] != "x" and text.splitlines()[-1].split()[-1] == "1"


def test_filters_and_unit_mismatch():
    recs = [record("1", "a", {"t": metric(1.0), "m": metric(1.0, "GiB")}, sweep="s1"),
            record("2", "b", {"t": metric(2.0, "ms"), "m": metric(2.0, "GiB")}, sweep="s1"),
            record("3", "c", {"t": metric(2.0)}, sweep="s2"),
            record("4", "d", {"t": metric(2.0)}, experiment="other")]
    (table,) = compare_records(recs, baseline="a", metrics=["t"], sweep="s1", experiment="exp")
    assert table.metrics == ["t"] and [r.system for r in table.rows] == ["a", "b"]
    assert by_system(table)["b"].cells["t"].ratio is None
    assert any("no ratio" in n for n in table.notes)


def test_sim_is_labelled_simulated_and_real_measured(results):
    from bench.record import load_records

    texts = {t.key.mode: format_table(t) for t in compare_records(load_records(results))}
    assert "mode=sim (simulated)" in texts["sim"] and "not measured" in texts["sim"]
    assert "mode=real (measured)" in texts["real"] and "simulated" not in texts["real"]
    assert "3 [2.5..3.5]" in texts["real"]  # p10..p90 shown when n > 1


# ------------------------------------------------------------------ command line

def test_main_prints_tables_and_writes_report_and_pngs(results, tmp_path, capsys):
    out = tmp_path / "report"
    assert compare.main(["--results", str(results), "--baseline", "zb", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "excluded 1 failed, 1 invalid" in text and "2.00x" in text
    report = (out / "report.md").read_text()
    assert "| system |" in report and "mode=sim (simulated)" in report
    pngs = sorted(out.glob("compare-*.png"))
    assert len(pngs) == 3  # sim: time, tput; real: time
    for png in pngs:
        assert png.read_bytes()[:8] == PNG_MAGIC
        assert f"({png.name})" in report


def test_report_defaults_to_the_results_dir(results, capsys):
    assert compare.main(["--results", str(results), "--metrics", "time"]) == 0
    assert (results / "report.md").exists()
    assert len(list(results.glob("compare-*.png"))) == 2


@pytest.mark.parametrize("setup,expected", [
    ("missing", "does not exist"),
    ("empty", "no records in"),
])
def test_missing_or_empty_results_dir_is_one_line_exit_2(tmp_path, capsys, setup, expected):
    d = tmp_path / "runs"
    if setup == "empty":
        d.mkdir()
    assert compare.main(["--results", str(d)]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1


def test_malformed_jsonl_line_names_file_and_line(results, capsys):
    jsonl = results / "records.jsonl"
    with open(jsonl, "a") as fh:
        fh.write('{"run_id": "torn", \n')
    n_lines = len(jsonl.read_text().splitlines())
    assert compare.main(["--results", str(results), "--no-report"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"records.jsonl:{n_lines}:" in err


def test_format_table_accepts_the_whole_list(results):
    from bench.record import load_records

    tables = compare_records(load_records(results))
    text = format_table(tables)
    assert text == compare.format_tables(tables) and text.count("== experiment=") == 2


def test_wide_tables_split_into_chunks_and_flat_spread_is_hidden():
    metrics = {f"metric_{i:02d}": metric(1.0 + i, n=5, p10=1.0 + i, p90=1.0 + i)
               for i in range(8)}
    (table,) = compare_records([record("1", "a", metrics), record("2", "b", metrics)])
    text = format_table(table, width=100)
    assert max(len(line) for line in text.splitlines() if not line.startswith(("==", "   "))) <= 100
    assert text.count("\nsystem ") >= 3 and all(f"metric_{i:02d}" in text for i in range(8))
    assert "[" not in text.split("\nsystem", 1)[1].replace("[s, lower=better]", "")


def test_groups_order_numbers_by_value():
    from bench.compare import _natural

    labels = ["link_delay[delay_s=0.06]", "link_delay[delay_s=0.0]", "link_delay[delay_s=0.01]"]
    assert sorted(labels, key=_natural) == ["link_delay[delay_s=0.0]", "link_delay[delay_s=0.01]",
                                            "link_delay[delay_s=0.06]"]
    assert sorted(["n=24", "n=3", "n=12"], key=_natural) == ["n=3", "n=12", "n=24"]


def test_real_record_invalid_for_a_contended_host_is_shown_never_compared(tmp_path):
    # A real run marked invalid by bench.host_load: listed with its reason, in no ratio.
    why = ("host contended: other processes took 97% of the host's CPU time (3.9 s on 2 cores "
           "over 2.0 s; bound validity.max_foreign_cpu_frac=0.25)")
    d = tmp_path / "runs"
    write_record(d, record("q1", "ondmd", {"ttft": metric(2.0)}, mode="real"))
    write_record(d, record("q2", "caraserve", {"ttft": metric(1.0)}, mode="real"))
    write_record(d, record("q3", "caraserve", {"ttft": metric(1.9)}, mode="real",
                           status="invalid", invalid_reasons=[why]))
    (table,) = compare_records(load_records(d), baseline="ondmd")
    rows = by_system(table)
    assert rows["caraserve"].cells["ttft"].ratio == pytest.approx(2.0)  # the valid run only
    text = format_table(table)
    assert f"invalid, not compared: caraserve (q3): {why}" in text


def test_one_system_group_has_no_ratio_column():
    # A preset that runs one system (swiftdiffusion/e1_latency): no "1.00x" against itself.
    (table,) = compare_records([record("1", "solo", {"t": metric(1.0)})])
    text = format_table(table)
    assert not table.has_ratios and "times better" not in text and "(baseline)" not in text
    assert text.splitlines()[-1].split()[-1] == "1"
