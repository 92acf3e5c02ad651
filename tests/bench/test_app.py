"""The Hydra app end to end: one-line errors, records, multirun, failure records, determinism."""
from __future__ import annotations

import json

import pytest

from bench.record import load_records, validate
from tests.conftest import TEST_ARGS, run_bench


@pytest.mark.parametrize("bad, expected", [
    (["system=nope"], "system=nope: no such system"),
    (["workload.typo=1"], "workload.typo"),
    (["mode=fast"], "mode=fast"),
    (["fault=nope"], "fault=nope: no such fault"),
    (["system.factor=abc"], "system.factor"),
    (["+system.unknown_knob=3"], "system.unknown_knob"),
    (["experiment=adaptra/nothing"], "experiment=adaptra/nothing: no such experiment (available: adaptra/"),
    (["hydra/launcher=nope"], "hydra/launcher=nope: no such hydra/launcher (available: basic, joblib"),
    (["hydra.launcher.n_jobs=2"], "hydra.launcher.n_jobs"),
    (["workload.iterations=${oops}"], "workload.iterations: Interpolation key 'oops' not found"),
])
def test_bad_input_is_one_line_without_traceback(tmp_path, bad, expected):
    proc = run_bench(["system=echo_a", *TEST_ARGS, f"results_dir={tmp_path}", *bad])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert expected in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "records.jsonl").exists(), "a rejected config must not start any job"


def test_single_job_writes_valid_record(tmp_path):
    proc = run_bench(["system=echo_a", *TEST_ARGS, f"results_dir={tmp_path}", "seed=7"])
    assert proc.returncode == 0, proc.stderr
    (rec,) = load_records(tmp_path)
    validate(rec)
    assert rec["status"] == "ok" and rec["error"] is None
    assert rec["system"] == "echo_a" and rec["mode"] == "sim" and rec["seed"] == 7
    assert rec["hardware"] == "test_hw" and rec["workload"] == "demo" and rec["fault"] == "none"
    assert rec["metrics"]["iteration_time_s"]["value"] == pytest.approx(1.007)
    on_disk = json.loads((tmp_path / rec["run_id"] / "record.json").read_text())
    assert on_disk == rec
    assert "seed=7" in rec["overrides"]


def test_raising_job_leaves_failed_record_and_sweep_goes_on(tmp_path):
    proc = run_bench(["--multirun", "system=echo_a,echo_b", "fault=none,kill_only_worker", *TEST_ARGS,
                      f"results_dir={tmp_path}"])
    assert proc.returncode == 1, proc.stderr  # the sweep ran every job, then reports the failures
    assert "2 of 4 jobs failed" in proc.stdout
    recs = load_records(tmp_path)
    assert len(recs) == 4
    failed = [r for r in recs if r["status"] == "failed"]
    assert len(failed) == 2
    for r in failed:
        assert r["fault"] == "kill_only_worker"
        assert "\n" not in r["error"] and "killed at iteration 0" in r["error"]
        assert (tmp_path / r["run_id"] / "error.log").read_text().startswith("Traceback")
    assert {r["sweep"] for r in recs} and len({r["sweep"] for r in recs}) == 1


def test_single_failed_job_exits_nonzero(tmp_path):
    proc = run_bench(["system=echo_a", "fault=kill_only_worker", *TEST_ARGS, f"results_dir={tmp_path}"])
    assert proc.returncode == 1
    (rec,) = load_records(tmp_path)
    assert rec["status"] == "failed"


def test_joblib_multirun_one_record_per_job(tmp_path):
    proc = run_bench(["--multirun", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "system=echo_a,echo_b",
                      "seed=1,2,3", *TEST_ARGS, f"results_dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert len(lines) == 6
    recs = [json.loads(line) for line in lines]  # every line parses: none torn
    assert sorted((r["system"], r["seed"]) for r in recs) == sorted(
        (s, k) for s in ("echo_a", "echo_b") for k in (1, 2, 3))
    assert len({r["provenance"]["host"]["hostname"] for r in recs}) == 1


def test_sim_metrics_bit_identical_across_runs(tmp_path):
    out = []
    for i in range(2):
        proc = run_bench(["system=echo_b", *TEST_ARGS, f"results_dir={tmp_path / str(i)}", "seed=3"])
        assert proc.returncode == 0, proc.stderr
        (rec,) = load_records(tmp_path / str(i))
        out.append(json.dumps(rec["metrics"], sort_keys=True))
    assert out[0] == out[1]


def test_planted_secret_appears_nowhere(tmp_path):
    secret = "planted-secret-9f8e7d6c5b4a"
    proc = run_bench(["system=echo_a", *TEST_ARGS, f"results_dir={tmp_path}", "logger=wandb",
                      f"logger.dir={tmp_path / 'wandb'}"],
                     env_extra={"WANDB_API_KEY": secret, "HF_TOKEN": secret, "MY_PASSWORD": secret,
                                "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr
    assert secret not in proc.stdout + proc.stderr
    (rec,) = load_records(tmp_path)
    assert rec["wandb"] is not None and rec["wandb"]["mode"] == "offline"
    hits = [p for p in tmp_path.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert hits == []


def test_working_directory_conf_adds_profiles_without_shadowing_ours(tmp_path):
    # A user's ./conf (e.g. hardware/local.yaml written by system=harness/calibrate) is searched after
    # the package's configs and never hides them, even though `python -m` puts cwd first.
    (tmp_path / "conf" / "hardware").mkdir(parents=True)
    (tmp_path / "conf" / "hardware" / "mybox.yaml").write_text(
        "name: mybox\nsource: test\npeak_flops: {fp32: 1.0e12}\nmemory_bytes: 1.0e9\n")
    proc = run_bench(["system=adaptra/zb", "hardware=mybox", "system.timeline=false", f"results_dir={tmp_path / 'r'}"],
                     cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (rec,) = load_records(tmp_path / "r")
    assert rec["hardware"] == "mybox" and rec["config"]["hardware"]["name"] == "mybox"
