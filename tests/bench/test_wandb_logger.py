"""bench.loggers: the no-op logger, W&B disabled and offline runs, and no leaked secrets."""
from __future__ import annotations

import pathlib

import pytest

from bench.config import LoggerConfig
from bench.loggers import JobLogger, LoggerError, make_logger

SECRET = "planted-secret-XYZ"
METRICS = {"iteration_time_s": {"value": 0.39, "unit": "s", "better": "lower", "n": 5,
                                "p50": 0.39, "p10": 0.38, "p90": 0.41}}


@pytest.fixture(scope="module", autouse=True)
def wandb_sandbox(tmp_path_factory):
    """Plant a secret and keep every wandb dir under one tmp root, for the whole module.

    Module-wide because wandb reads its environment once per process (at setup): the secret
    must be there before the first run, whichever test makes it.
    """
    root = tmp_path_factory.mktemp("wandb-sandbox")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_API_KEY", SECRET)  # wandb may read it; it must never write it
        mp.setenv("MLSYS_BENCH_TEST_TOKEN", SECRET)
        for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR",
                    "WANDB_ARTIFACT_DIR"):
            mp.setenv(var, str(root / var.lower()))
        yield root
    import wandb

    wandb.teardown()  # stop the service process these tests started


def job_args(run_id: str) -> dict:
    return dict(run_id=run_id, experiment="demo", system="zb", mode="sim", hardware="h800",
                fault="none", workload="pipeline_s4",
                config={"system": {"name": "zb", "queue_depth": 1}, "seed": 0})


def tiny_png(path: pathlib.Path) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1, 1))
    ax.plot([0, 1], [1, 0])
    fig.savefig(path, dpi=20)
    plt.close(fig)
    return path


def test_none_logger_is_a_noop(tmp_path):
    lg = make_logger(LoggerConfig(name="none"), tmp_path)
    assert type(lg) is JobLogger
    lg.start(**job_args("r0"))
    lg.log_result(METRICS, [], "ok")
    assert lg.finish() is None
    assert list(tmp_path.iterdir()) == []


def test_unknown_logger_and_mode_are_one_line_errors(tmp_path, monkeypatch):
    with pytest.raises(LoggerError, match=r"^logger.name: 'mlflow' is not a logger"):
        make_logger(LoggerConfig(name="mlflow"), tmp_path)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with pytest.raises(LoggerError, match=r"^logger.mode: 'onlin' is not a W&B mode"):
        make_logger(LoggerConfig(name="wandb", mode="onlin"), tmp_path)
    monkeypatch.setenv("WANDB_MODE", "nope")
    with pytest.raises(LoggerError, match=r"^WANDB_MODE: 'nope'"):
        make_logger(LoggerConfig(name="wandb"), tmp_path)


def test_wandb_mode_env_wins_over_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert make_logger(LoggerConfig(name="wandb", mode="offline"), tmp_path).mode == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    assert make_logger(LoggerConfig(name="wandb"), tmp_path).mode == "offline"  # the default


def test_disabled_mode_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    lg = make_logger(LoggerConfig(name="wandb"), tmp_path / "job")
    for i in range(2):  # several jobs in one process, as in a basic-launcher multirun
        lg.start(**job_args(f"run-{i}"))
        lg.log_result(METRICS, [], "ok")
        assert lg.finish() == {"mode": "disabled", "run_id": None, "dir": None}
    files = [p for p in (tmp_path / "job").rglob("*") if p.is_file()] \
        if (tmp_path / "job").exists() else []
    assert files == []


def test_offline_run_dir_images_and_no_secret(tmp_path, monkeypatch, wandb_sandbox):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    out = tmp_path / "job"
    out.mkdir()
    png = tiny_png(out / "timeline.png")
    returned = []
    for i in range(2):  # the second run must not reuse the first (reinit semantics)
        lg = make_logger(LoggerConfig(name="wandb"), out)  # offline by default
        lg.start(**job_args(f"20260101T000000-zb-{i:06x}"))
        lg.log_result(METRICS, [png, pathlib.Path("missing.png")], "ok")
        returned.append(lg.finish())
    for i, info in enumerate(returned):
        run_id = f"20260101T000000-zb-{i:06x}"
        assert info["mode"] == "offline" and info["run_id"] == run_id
        run_dir = pathlib.Path(info["dir"])
        assert run_dir.is_dir() and run_dir.name.startswith("offline-run-")
        assert run_dir.name.endswith(run_id) and run_dir.parent == out / "wandb"
        assert (run_dir / f"run-{run_id}.wandb").is_file()
        assert list(run_dir.rglob("media/images/**/*.png")), "PNG artifact not logged"
    written = [p for root in (tmp_path, wandb_sandbox) for p in root.rglob("*") if p.is_file()]
    assert len(written) > 4
    for path in written:
        assert SECRET.encode() not in path.read_bytes(), f"secret written to {path}"


def test_logger_dir_setting_overrides_job_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    lg = make_logger(LoggerConfig(name="wandb", dir=str(tmp_path / "wb")), tmp_path / "job")
    lg.start(**job_args("dir-test"))
    info = lg.finish()
    assert pathlib.Path(info["dir"]).parent == tmp_path / "wb" / "wandb"
    assert lg.finish() is None  # finishing twice is harmless


def test_report_site_logged_as_offline_artifact(tmp_path, monkeypatch, wandb_sandbox):
    from bench.loggers.wandb_logger import log_report_artifact

    monkeypatch.delenv("WANDB_MODE", raising=False)
    site = tmp_path / "report"
    (site / "fig").mkdir(parents=True)
    (site / "index.html").write_text("<html><body>index</body></html>")
    tiny_png(site / "fig" / "a.png")
    info = log_report_artifact(site)  # offline by default, run folder inside the site
    assert info["mode"] == "offline"
    run_dir = pathlib.Path(info["dir"])
    assert run_dir.is_dir() and run_dir.parent == site / "wandb"
    (log,) = run_dir.glob("run-*.wandb")
    # The artifact's manifest (name, type, both files) is in the offline run's log. wandb's
    # service process may still be writing that log when finish() returns: allow it a moment.
    import time

    want = (b"mlsys-bench-report", b"index.html", b"fig/a.png")
    deadline = time.monotonic() + 20
    data = log.read_bytes()
    while not all(w in data for w in want) and time.monotonic() < deadline:
        time.sleep(0.2)
        data = log.read_bytes()
    assert all(w in data for w in want), data[:200]
