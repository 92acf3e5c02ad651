"""bench.gate: yaml validation, pass/fail on ratios and bounds, interleaving, exit codes."""
from __future__ import annotations

import pathlib
import sys
import textwrap

import pytest

from bench import gate
from bench.record import new_run_id, now_iso, write_record

REPO = pathlib.Path(__file__).resolve().parents[2]


def record(system, mode, status="ok", metrics=None, error=None):
    return {"schema": "mlsys-bench.record/1", "run_id": new_run_id(system), "created": now_iso(),
            "status": status, "error": error, "experiment": "exp", "system": system,
            "mode": mode, "workload": "w", "hardware": "h", "fault": "none", "seed": 0,
            "metrics": metrics or {},
            "provenance": {"git": {"commit": None, "dirty": None}, "packages": {}, "host": {},
                           "devices": [], "container_image": None, "emulated": []},
            "config": {}, "overrides": [], "wandb": None}


class FakeRunner:
    """Stands in for `python -m bench`: writes a synthetic record per call, deterministically.

    ``values[system]`` (or ``values[(system, "case=<k>")]`` for a gate whose cases pass a
    ``case=<k>`` override) is a list consumed one per run (repeats), "failed" or "invalid".
    """

    def __init__(self, values, unit="s", better="lower"):
        self.values = {k: (list(v) if isinstance(v, list) else v) for k, v in values.items()}
        self.unit, self.better, self.calls = unit, better, []

    def __call__(self, cmd, results_dir):
        args = dict(a.split("=", 1) for a in cmd if "=" in a and not a.startswith("+"))
        system, mode = args["system"], args["mode"]
        assert args["results_dir"] == str(results_dir)
        self.calls.append((system, mode, cmd))
        case = next((a for a in cmd if a.startswith("case=")), None)
        v = self.values[(system, case)] if (system, case) in self.values else self.values[system]
        if v == "invalid":  # e.g. a real run beside other jobs (bench.host_load)
            write_record(results_dir, record(system, mode, "invalid", metrics={}) | {
                "invalid_reasons": ["host contended: other processes took 97% of the host's CPU"]})
            return 0, ""
        if v == "failed":
            write_record(results_dir, record(system, mode, "failed",
                                             error="RuntimeError: rank 1 died"))
            return 1, "RuntimeError: rank 1 died"
        value = v.pop(0) if isinstance(v, list) else v
        m = {"time": {"value": value, "unit": self.unit, "better": self.better, "n": 3,
                      "p50": value, "p10": value, "p90": value}}
        write_record(results_dir, record(system, mode, metrics=m))
        return 0, ""


def write_suite(d: pathlib.Path, name: str, body: str) -> pathlib.Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.yaml").write_text(textwrap.dedent(body))
    return d


SIM_GATE = """\
gates:
  - name: fast_enough
    overrides: ["+experiment=demo/default"]
    candidate: new
    baseline: old
    metric: time
    mode: sim
    min_ratio: 1.5
"""


def run_main(tmp_path, body, runner, *extra):
    gdir = write_suite(tmp_path / "gates", "suite", body)
    return gate.main(["--gate-dir", str(gdir), "--results", str(tmp_path / "runs"), *extra],
                     runner=runner)


def test_sim_gate_passes_on_exact_ratio(tmp_path, capsys):
    runner = FakeRunner({"new": 1.0, "old": 1.5})  # exactly 1.5x better
    assert run_main(tmp_path, SIM_GATE, runner) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "1.5x" in out and "1 passed, 0 failed" in out
    assert [c[:2] for c in runner.calls] == [("new", "sim"), ("old", "sim")]  # one run each
    cmd = runner.calls[0][2]
    assert cmd[:3] == [sys.executable, "-m", "bench"]
    assert cmd[3] == "+experiment=demo/default" and "mode=sim" in cmd


def test_sim_gate_fails_below_min_ratio_with_exit_1(tmp_path, capsys):
    assert run_main(tmp_path, SIM_GATE, FakeRunner({"new": 1.0, "old": 1.4})) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "ratio 1.4x < required 1.5x" in out


def test_higher_is_better_ratio(tmp_path):
    runner = FakeRunner({"new": 300.0, "old": 100.0}, unit="tok/s", better="higher")
    assert run_main(tmp_path, SIM_GATE, runner) == 0


def test_real_gate_interleaves_and_compares_medians_with_tolerance(tmp_path, capsys):
    body = """\
    gates:
      - {name: real_gate, candidate: new, baseline: old, metric: time, mode: real,
         min_ratio: 1.0, repeats: 3, tolerance: 0.1}
    """
    # medians: candidate 1.05, baseline 1.0 -> ratio 0.952 >= 1.0 * (1 - 0.1)
    runner = FakeRunner({"new": [1.05, 9.0, 1.0], "old": [1.0, 1.0, 0.5]})
    assert run_main(tmp_path, body, runner) == 0
    assert [c[0] for c in runner.calls] == ["new", "old"] * 3
    assert all(c[1] == "real" for c in runner.calls)
    capsys.readouterr()
    runner = FakeRunner({"new": [1.2, 1.2, 1.2], "old": [1.0, 1.0, 1.0]})  # 0.83 < 0.9
    assert run_main(tmp_path, body, runner) == 1
    assert ">=0.9x (1x -10%)" in capsys.readouterr().out


def test_value_bounds_without_baseline(tmp_path, capsys):
    body = """\
    gates:
      - {name: bounded, candidate: new, metric: time, mode: sim, max_value: 2.0, min_value: 0.5}
    """
    runner = FakeRunner({"new": 1.0})
    assert run_main(tmp_path, body, runner) == 0
    assert [c[0] for c in runner.calls] == ["new"]  # no baseline run needed
    assert run_main(tmp_path, body, FakeRunner({"new": 3.0})) == 1
    assert "value 3 > max_value 2" in capsys.readouterr().out


def test_failed_job_is_a_fail_with_its_error_line(tmp_path, capsys):
    assert run_main(tmp_path, SIM_GATE, FakeRunner({"new": "failed", "old": 1.0})) == 1
    out = capsys.readouterr().out
    assert "status failed: RuntimeError: rank 1 died" in out


def test_missing_metric_is_a_fail_naming_what_exists(tmp_path, capsys):
    body = SIM_GATE.replace("metric: time", "metric: latency")
    assert run_main(tmp_path, body, FakeRunner({"new": 1.0, "old": 2.0})) == 1
    assert "metric 'latency' not in record (has: time)" in capsys.readouterr().out


def test_job_that_writes_no_record_is_a_fail(tmp_path, capsys):
    assert run_main(tmp_path, SIM_GATE, lambda cmd, d: (2, "ConfigError: system.x: bad")) == 1
    assert "job wrote 0 records (ConfigError: system.x: bad)" in capsys.readouterr().out


@pytest.mark.parametrize("body,expected", [
    (SIM_GATE + "    colour: red\n", "gates[0].colour: unknown key"),
    (SIM_GATE + "extra: 1\n", "extra: unknown key"),
    (SIM_GATE.replace("    candidate: new\n", ""), "gates[0].candidate: missing"),
    (SIM_GATE.replace("mode: sim", "mode: simm"), "gates[0].mode:"),
    (SIM_GATE.replace("min_ratio: 1.5", "min_ratio: fast"), "gates[0].min_ratio:"),
    (SIM_GATE + "    tolerance: 0.1\n", "gates[0].tolerance: applies to real gates only"),
    (SIM_GATE.replace("    baseline: old\n", ""), "gates[0].baseline: min_ratio needs"),
    ("gates: [\n", "suite.yaml:2: invalid YAML"),
])
def test_config_errors_are_one_line_exit_2(tmp_path, capsys, body, expected):
    def never(cmd, d):  # a config error must stop before any job runs
        raise AssertionError("ran a job")

    assert run_main(tmp_path, body, never) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err


def test_unknown_suite_and_dry_run(tmp_path, capsys):
    gdir = write_suite(tmp_path / "gates", "suite", SIM_GATE)
    assert gate.main(["nope", "--gate-dir", str(gdir)]) == 2
    assert "gate suite 'nope' not found" in capsys.readouterr().err
    assert gate.main(["--gate-dir", str(gdir), "--dry-run"], runner=None) == 0
    out = capsys.readouterr().out
    assert "fast_enough: 1x" in out and "system=new" in out and "system=old" in out


def test_subprocess_runner_reports_a_crashing_job(tmp_path, capsys):
    # A real subprocess, without needing the app: the job prints an error and exits 3.
    prefix = [sys.executable, "-c", "import sys; sys.exit('SystemError: planted crash')"]
    gdir = write_suite(tmp_path / "gates", "suite", SIM_GATE)
    assert gate.main(["--gate-dir", str(gdir), "--results", str(tmp_path / "r")],
                     prefix=prefix) == 1
    assert "job wrote 0 records (SystemError: planted crash)" in capsys.readouterr().out


@pytest.mark.real
@pytest.mark.skipif(not (REPO / "conf/system/harness/calibrate.yaml").exists(),
                    reason="conf/system/harness/calibrate.yaml not there yet: no system to run")
def test_real_subprocess_run_of_the_calibrate_system(tmp_path):
    # One real `python -m bench` job (~10 s on 2 busy cores with these small sizes); the
    # output override keeps calibration from rewriting conf/hardware/local.yaml.
    overrides = [f"system.output={tmp_path / 'local.yaml'}", "system.dtypes=[fp32]",
                 "system.repeats=3", "system.warmup=1", "system.matmul_sizes=[128]",
                 "system.p2p_sizes_bytes=[8,1024]", "system.allreduce_sizes_bytes=[8]",
                 "system.mem_bw_bytes=1048576",
                 # The gate's job plumbing is under test, not the host's load (a busy host
                 # makes a real record invalid: tests/bench/test_host_load.py).
                 "validity.max_foreign_cpu_frac=null"]
    probe = gate.Gate(name="calib", candidate="calibrate", metric="?", mode=gate.GateMode.real,
                      overrides=overrides, max_value=float("inf"), repeats=1)
    out = gate.run_job(probe, "calibrate", tmp_path / "runs", gate.subprocess_runner,
                       [sys.executable, "-m", "bench"])
    assert out.record is not None, out.error
    assert out.record["system"] == "calibrate" and out.record["status"] == "ok"
    probe.metric = next(iter(out.record["metrics"]))  # any metric: the bound is loose
    result = gate.judge(probe, [out], [])
    assert result.passed, result.reasons
    assert result.candidate_value == out.record["metrics"][probe.metric]["value"]


def test_malformed_results_jsonl_is_exit_2_naming_the_line(tmp_path, capsys):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "records.jsonl").write_text('{"run_id": \n')
    assert run_main(tmp_path, SIM_GATE, FakeRunner({"new": 1.0, "old": 1.0})) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "records.jsonl:1:" in err


def test_shipped_suites_validate(capsys):
    # Every bench/data/gates/*.yaml in the repo must at least parse and type-check.
    assert gate.main(["--dry-run"]) == 0
    assert "zb_beats_1f1b_sim" in capsys.readouterr().out


def test_invalid_real_record_is_refused_with_its_reason(tmp_path, capsys):
    body = """\
    gates:
      - {name: real_gate, candidate: new, baseline: old, metric: time, mode: real,
         min_ratio: 1.0, repeats: 1}
    """
    assert run_main(tmp_path, body, FakeRunner({"new": "invalid", "old": 1.0})) == 1
    out = capsys.readouterr().out
    assert "candidate new: status invalid: host contended" in out and "FAIL" in out


CASES_GATE = """\
gates:
  - name: mean_speedup
    overrides: [experiment=x]
    cases: [[case=0], [case=1], [case=2]]
    aggregate: {agg}
    candidate: new
    baseline: old
    metric: time
    mode: sim
    {bounds}
"""

# Per-case speedups 1.5x, 3x, 6x: mean 3.5x, min 1.5x, max 6x.
CASE_VALUES = {("new", "case=0"): 2.0, ("old", "case=0"): 3.0, ("new", "case=1"): 1.0,
               ("old", "case=1"): 3.0, ("new", "case=2"): 0.5, ("old", "case=2"): 3.0}


@pytest.mark.parametrize("agg,bounds,passes,why", [
    ("mean", "min_ratio: 3.5", True, ""),
    ("mean", "min_ratio: 3.6", False, "ratio 3.5x < required 3.6x"),
    ("mean", "max_ratio: 3.4", False, "ratio 3.5x > max_ratio 3.4x"),
    ("min", "min_ratio: 1.5", True, ""),
    ("min", "min_ratio: 1.6", False, "ratio 1.5x < required 1.6x"),
    ("max", "min_ratio: 6.0", True, ""),
    ("each", "{min_ratio: 1.5, max_ratio: 6.0}", True, ""),
    ("each", "max_ratio: 5.0", False, "case 2 (case=2): ratio 6x > max_ratio 5x"),
    ("each", "max_value: 1.5", False, "case 0 (case=0): value 2 > max_value 1.5"),
])
def test_cases_are_judged_by_their_aggregate(tmp_path, capsys, agg, bounds, passes, why):
    body = CASES_GATE.format(agg=agg, bounds=bounds)
    if bounds.startswith("{"):
        body = body.replace(f"    {bounds}\n", "    min_ratio: 1.5\n    max_ratio: 6.0\n")
    runner = FakeRunner(CASE_VALUES)
    assert run_main(tmp_path, body, runner) == (0 if passes else 1)
    out = capsys.readouterr().out
    assert why in out
    # One job per (case, side), each with the gate's overrides then the case's own; a gate
    # that bounds only the candidate's value runs no baseline.
    sides = ("new", "old") if "ratio" in bounds else ("new",)
    assert [(c[0], c[2][3:5]) for c in runner.calls] == [
        (s, ["experiment=x", f"case={k}"]) for k in range(3) for s in sides]
    if "ratio" in bounds:
        assert "case 1 (case=1): candidate 1, baseline 3, ratio 3x, diff +2" in out


def test_min_diff_is_candidate_minus_baseline_in_the_better_direction(tmp_path, capsys):
    body = """\
    gates:
      - {name: margin, candidate: new, baseline: old, metric: time, mode: sim, min_diff: 0.08,
         min_value: 0.99}
    """
    higher = dict(unit="fraction", better="higher")
    assert run_main(tmp_path, body, FakeRunner({"new": 0.998, "old": 0.917}, **higher)) == 0
    assert "+0.081" in capsys.readouterr().out
    assert run_main(tmp_path, body, FakeRunner({"new": 0.998, "old": 0.93}, **higher)) == 1
    assert "diff 0.068 < min_diff 0.08" in capsys.readouterr().out
    assert run_main(tmp_path, body, FakeRunner({"new": 0.98, "old": 0.5}, **higher)) == 1
    assert "value 0.98 < min_value 0.99" in capsys.readouterr().out
    # Lower is better: baseline minus candidate.
    lower = body.replace("min_value: 0.99", "max_value: 9")
    assert run_main(tmp_path, lower, FakeRunner({"new": 1.0, "old": 1.1})) == 0
    assert run_main(tmp_path, lower, FakeRunner({"new": 1.0, "old": 1.05})) == 1


@pytest.mark.parametrize("body,expected", [
    (SIM_GATE + "    aggregate: min\n", "gates[0].aggregate: applies to gates with cases only"),
    (SIM_GATE + "    cases: [[a=1], []]\n", "gates[0].cases[1]: empty case"),
    (SIM_GATE + "    aggregate: median\n    cases: [[a=1]]\n", "gates[0].aggregate:"),
    (SIM_GATE.replace("min_ratio: 1.5", "min_diff: 0.1").replace("    baseline: old\n", ""),
     "gates[0].baseline: min_diff needs a baseline system"),
    (SIM_GATE.replace("min_ratio: 1.5", "max_ratio: 0"), "gates[0].max_ratio: must be > 0"),
])
def test_case_and_bound_config_errors(tmp_path, capsys, body, expected):
    assert run_main(tmp_path, body, None) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
