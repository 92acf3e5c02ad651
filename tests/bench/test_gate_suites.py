"""Every sim gate suite in bench/data/gates runs in the default test command, and a gate that falls
short fails the run. Sim gates are exact, so these are deterministic; real suites stay out
(noisy: run them with `mlsys-bench-gate <suite>` on a quiet host)."""
from __future__ import annotations

import pathlib
import sys

import pytest
from omegaconf import OmegaConf

from bench import gate

GATE_DIR = gate.default_gate_dir()


def _suite_modes() -> dict[str, set[str]]:
    return {p.stem: {g.mode.value for g in gate.load_suite(p)}
            for p in sorted(GATE_DIR.glob("*.yaml"))}


SIM_SUITES = [name for name, modes in _suite_modes().items() if modes == {"sim"}]


def test_every_suite_is_sim_or_real_not_both():
    # A mixed suite would either drag a noisy real gate into CI or keep a sim gate out of it.
    mixed = {name: sorted(m) for name, m in _suite_modes().items() if len(m) > 1}
    assert not mixed, f"split these suites by mode: {mixed}"
    assert {"smoke", "adaptra", "malleus", "caraserve", "fisedit", "hotspa", "hydraulis", "lobra", "ckpt_recovery"} <= set(SIM_SUITES)


@pytest.mark.parametrize("suite", SIM_SUITES)
def test_sim_gate_suite_passes(suite, tmp_path, capsys):
    rc = gate.main([suite, "--results", str(tmp_path / "runs")])
    out = capsys.readouterr().out
    assert rc == 0, out[-4000:]
    n = len(gate.load_suite(GATE_DIR / f"{suite}.yaml"))
    assert f"{n} passed, 0 failed" in out


def test_a_gate_that_falls_short_fails_the_run(tmp_path, capsys):
    # The smoke suite with its bound raised just past its exact figure (ZB 15/13 = 1.154x
    # over 1F1B): the same jobs must now fail the run, naming the shortfall.
    raw = OmegaConf.load(GATE_DIR / "smoke.yaml")
    assert raw.gates[0].min_ratio == 1.15
    raw.gates[0].min_ratio = 1.16
    gdir = tmp_path / "gates"
    gdir.mkdir()
    OmegaConf.save(raw, gdir / "smoke.yaml")
    rc = gate.main(["smoke", "--gate-dir", str(gdir), "--results", str(tmp_path / "runs")])
    out = capsys.readouterr().out
    assert rc == 1, out[-4000:]
    assert "zb_beats_1f1b_sim: FAIL: ratio 1.154x < required 1.16x" in out
    assert "0 passed, 1 failed" in out


def test_inprocess_runner_writes_the_records_the_cli_writes(tmp_path):
    # The fast path sim suites use: same job, run by the CLI in a subprocess and in-process,
    # must give the same metrics and the same resolved config.
    (g,) = gate.load_suite(GATE_DIR / "smoke.yaml")
    recs = {}
    for name, runner in (("cli", gate.subprocess_runner), ("inproc", gate.inprocess_runner)):
        out = gate.run_job(g, g.candidate, tmp_path / name, runner, [sys.executable, "-m", "bench"])
        assert out.record is not None and out.record["status"] == "ok", out.error
        recs[name] = out.record
    metrics = {k: {m: v["value"] for m, v in r["metrics"].items()} for k, r in recs.items()}
    assert metrics["cli"] == metrics["inproc"]
    strip = lambda c: {k: v for k, v in c.items() if k != "results_dir"}  # noqa: E731
    assert strip(recs["cli"]["config"]) == strip(recs["inproc"]["config"])
    assert recs["cli"]["workload"] == recs["inproc"]["workload"] and recs["cli"]["experiment"] == recs["inproc"]["experiment"]
