"""The pass aggregation of ``mlsys-bench-fidelity-passes`` (no real runs: synthetic rows)."""
import pathlib

import pytest

from bench.fidelity import passes


def _row(family, situation, err, status="ok", real=1.0, metric="iteration_time_s"):
    return {"family": family, "situation": situation, "workload": None, "fault": "none", "metric": metric,
            "real": real, "sim": real * (1 + err / 100), "error_pct": err, "status": status}


def test_spread_keeps_every_pass_and_ranges_only_valid_rows():
    p1 = [_row("serving", "cached", -3.0, real=0.050)]
    p2 = [_row("serving", "cached", -12.0, real=0.055)]
    p3 = [_row("serving", "cached", +40.0, status="invalid", real=0.080)]
    (r,) = passes.row_spread([p1, p2, p3])
    assert r["error_pct"] == [-3.0, -12.0, 40.0] and r["status"] == ["ok", "ok", "invalid"]
    assert (r["error_min"], r["error_max"]) == (-12.0, -3.0)  # the invalid pass is shown, not ranged
    assert r["real_spread_pct"] == pytest.approx(100 * 0.005 / 0.0525)


def test_a_row_missing_from_one_pass_is_none_there():
    rows = passes.row_spread([[_row("pipeline", "zb", 1.0)], []])
    assert rows[0]["error_pct"] == [1.0, None]


def test_verdict_counts_a_family_out_of_band_when_invalid_or_beyond_10pct():
    rows = [_row("pipeline", "zb", -9.9), _row("hybrid", "malleus", 10.5),
            _row("serving", "cached", 1.0), _row("serving", "ondmd", 1.0, status="invalid")]
    (v,) = passes.pass_verdicts([rows], ["pipeline", "hybrid", "serving", "diffusion"])
    fam = v["families"]
    assert fam["pipeline"]["within_band"] and not fam["hybrid"]["within_band"]
    assert not fam["serving"]["within_band"] and fam["serving"]["invalid_rows"] == 1
    assert not fam["diffusion"]["within_band"] and fam["diffusion"]["valid_rows"] == 0
    assert v["families_within_band"] == 1


def test_profile_spread_ranks_the_field_that_moved():
    a = {"local": {"peak_flops": {"fp32": 100.0}, "memory_bw_bytes_per_s": 10.0, "name": "local"}}
    b = {"local": {"peak_flops": {"fp32": 130.0}, "memory_bw_bytes_per_s": 10.0, "name": "local"}}
    top = passes.profile_spread([a, b])
    assert top[0]["field"] == "peak_flops.fp32" and top[0]["values"] == [100.0, 130.0]
    assert top[0]["spread_pct"] == pytest.approx(100 * 30 / 115)
    assert top[-1]["spread_pct"] == 0.0


def test_markdown_marks_invalid_cells_and_out_of_band_families():
    rows = [[_row("pipeline", "zb", -12.0)], [_row("pipeline", "zb", 2.0, status="invalid")]]
    md = passes.format_markdown(passes.row_spread(rows), passes.pass_verdicts(rows, ["pipeline"]), [], 2)
    assert "| pipeline | zb | none | iteration_time_s | -12.0 | +2.0 (invalid) |" in md
    assert "12.0 (out)" in md


def test_a_record_priced_with_a_profile_outside_the_pass_is_stale(tmp_path):
    inside = tmp_path / "conf" / "hardware" / "local.yaml"
    recs = [{"info": {"fidelity": {"sim_hardware_path": str(inside)}}},
            {"info": {"fidelity": {"sim_hardware_path": "/elsewhere/conf/hardware/local-t1.yaml"}}}]
    assert passes.stale_profiles(recs, tmp_path) == ["/elsewhere/conf/hardware/local-t1.yaml"]


def test_a_package_profile_that_every_pass_would_reuse_is_refused(tmp_path, monkeypatch):
    (tmp_path / "local-t1.yaml").write_text("name: local-t1\n")
    monkeypatch.setattr(passes, "hardware_dir", lambda: pathlib.Path(tmp_path))
    with pytest.raises(SystemExit, match="local-t1.yaml exists and would be reused"):
        passes.main(["--passes", "1", "--out", str(tmp_path / "out")])
