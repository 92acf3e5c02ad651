"""``mlsys-bench-runs`` and ``mlsys-bench-calibrate-megatron`` end to end on a slice of the
shipped H100 runs file: the predictions file's fields, the PNG, the error table, the written
profile's provenance, and one-line errors."""
from __future__ import annotations

import gzip
import json
import pathlib

import pytest

from bench.megatron_runs import calibrate_main, main
from impl.common.hardware import load_hardware
from impl.common.megatron.runs import file_sha256

RUNS = pathlib.Path(__file__).resolve().parents[2] / "impl/common/megatron/data/megatron_h100_feb2024.jsonl.gz"
FIELDS = {"id", "predicted_fits", "predicted_peak_allocated_mb", "predicted_iteration_ms",
          "measured_iteration_ms", "measured_peak_allocated_mb", "measured_fits", "status", "mode"}


@pytest.fixture(scope="module")
def runs_slice(tmp_path_factory):
    lines = gzip.open(RUNS, "rt").read().splitlines()
    path = tmp_path_factory.mktemp("runs") / "slice.jsonl"
    path.write_text("\n".join(lines[::5]) + "\n")
    return path, len(lines[::5])


def test_runs_cli_writes_predictions_table_and_png(runs_slice, tmp_path, capsys):
    path, n = runs_slice
    assert main(["--runs", str(path), "--folds", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "pad iteration time" in out and "fit / OOM verdict" in out and "2-fold cross-validated" in out
    preds = [json.loads(x) for x in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == n and all(FIELDS <= set(p) for p in preds)
    assert all(p["predicted_iteration_ms"] is None for p in preds if not p["predicted_fits"])
    assert all(p["fold"] in (0, 1) for p in preds)
    assert (tmp_path / "pred_vs_measured.png").stat().st_size > 10_000
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["runs_sha256"] == file_sha256(path) and summary["table"]["verdict"]["n"] > 0


def test_calibrate_writes_a_profile_with_provenance(runs_slice, tmp_path, capsys):
    path, _ = runs_slice
    out = tmp_path / "h100-test.yaml"
    assert calibrate_main(["--runs", str(path), "--output", str(out), "--folds", "0"]) == 0
    prof = load_hardware(str(out))
    assert prof.name == "h100-test" and prof.megatron.knobs is not None
    assert prof.calibration["runs_sha256"] == file_sha256(path) and prof.calibration["base_profile"] == "h100-sxm"
    assert 0.8 <= prof.megatron.knobs.gemm_time_factor <= 1.5 and prof.megatron.knobs.allocatable_bytes <= prof.memory_bytes
    assert prof.megatron.kernels is not None and prof.calibration["kernels_measured_on"] == "h200"
    assert isinstance(prof.calibration["fit"]["at_bound"], list)
    # Pricing with the written profile uses its knobs (in-sample on the slice it was fitted on).
    assert main(["--runs", str(path), "--hardware", str(out), "--out", str(tmp_path / "p")]) == 0
    assert "priced with hardware h100-test's knobs" in capsys.readouterr().out


def test_runs_cli_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "status": "ok", "effective": {"dp": 1, "tp": 0}}\n')
    assert main(["--runs", str(bad), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{bad}:1: effective.tp:" in err
    assert main(["--runs", str(tmp_path / "missing.jsonl")]) == 2
    assert "--runs: no such file" in capsys.readouterr().err
    assert main(["--runs", str(bad), "--folds", "1"]) == 2
    assert "--folds: needs >= 2" in capsys.readouterr().err
