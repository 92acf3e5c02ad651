"""The CPU image and the docker launcher (bench/launchers/docker.py).

Tests marked ``container`` need a docker engine (``bash .ci/docker.sh`` starts one); without
it they skip with the reason. They build the base image if it is missing (debootstrap, root)
and the image (``containers/build_image.sh``: cached layers make a rebuild after a code
change take seconds), then run one cheap calibration job in it with no network.
The other tests check the launcher's own logic and need no engine.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from bench.launchers import docker as launcher
from bench.record import validate

REPO = Path(__file__).resolve().parents[2]
IMAGE = launcher.DEFAULT_IMAGE
BASE_IMAGE = "mlsys-bench-base:bookworm"

# calibrate with tiny problems: ~10-25 s on 2 busy cores, real mode, two gloo processes.
CHEAP_JOB = [
    "system=harness/calibrate", "mode=real", "progress=false",
    "system.matmul_sizes=[64,128]", "system.dtypes=[fp32]", "system.warmup=1", "system.repeats=3",
    "system.min_repeats=2", "system.mem_bw_bytes=1048576",
    "system.p2p_sizes_bytes=[8,65536]", "system.allreduce_sizes_bytes=[8]",
    # The container's plumbing is under test, not the host: a busy CI host must not make the
    # record invalid (tests/bench/test_host_load.py tests that rule).
    "validity.max_foreign_cpu_frac=null",
]


# ---- launcher logic (no engine needed) ---------------------------------------------------

def test_inner_overrides_drop_launcher_keys():
    got = launcher.inner_overrides(["system=adaptra/zb", "results_dir=/x", "launcher=docker",
                                    "container_image=foo:1", "++results_dir=/y", "seed=3"])
    assert got == ["system=adaptra/zb", "seed=3", "results_dir=/results"]


def test_unreachable_engine_is_one_clear_line(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(launcher.EngineUnavailable) as err:
        launcher.run_in_container(["system=harness/calibrate"], "/tmp/unused")
    msg = str(err.value)
    assert msg.startswith("docker engine not reachable at unix:///nonexistent/docker.sock: start dockerd")
    assert "\n" not in msg
    assert launcher.engine_unavailable_reason() == msg
    assert launcher.main(["system=harness/calibrate", "results_dir=/tmp/unused"]) == 2


def test_prepare_results_dir_makes_shared_places_group_writable(tmp_path):
    results = tmp_path / "runs"
    (results / "_hydra").mkdir(parents=True)
    os.chmod(results / "_hydra", 0o755)
    launcher.prepare_results_dir(results, gid=os.getgid())
    for p in (results, results / "_hydra"):
        mode = p.stat().st_mode
        assert mode & stat.S_IWGRP and mode & stat.S_IXGRP and mode & stat.S_ISGID, oct(mode)
    for name in ("records.jsonl", "records.jsonl.lock"):
        assert (results / name).stat().st_mode & stat.S_IWGRP


# ---- the image, for real ------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    reason = launcher.engine_unavailable_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def image_id(engine) -> str:
    have_base = subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True).returncode == 0
    if not have_base and os.geteuid() != 0:
        pytest.skip(f"{BASE_IMAGE} missing and containers/build_base.sh (debootstrap) needs root")
    env = {**os.environ, "IMAGE": IMAGE, "BASE_IMAGE": BASE_IMAGE, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "containers" / "build_image.sh")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"build_image.sh failed:\n{proc.stderr[-4000:]}"
    print(proc.stderr, file=sys.stderr)  # step timings, shown with -s / on failure
    image = proc.stdout.strip().splitlines()[-1]
    assert image.startswith("sha256:")
    assert launcher.image_id(IMAGE) == image
    return image


@pytest.mark.container
def test_missing_image_is_one_clear_line(engine):
    with pytest.raises(launcher.ImageMissing) as err:
        launcher.run_in_container(["system=harness/calibrate"], "/tmp/unused", image="mlsys-bench:no-such-tag")
    assert str(err.value) == "image mlsys-bench:no-such-tag not found: build it with containers/build_image.sh"


@pytest.mark.container
def test_job_in_container_writes_a_valid_record(image_id, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "not-a-real-secret-0123456789")  # must not reach the container
    results = tmp_path / "runs"
    run = launcher.run_in_container(CHEAP_JOB, results, image=IMAGE, network="none", stream=False,
                                    timeout_s=600)
    assert run.exit_code == 0, run.logs[-4000:]
    assert run.image_id == image_id

    # one record, in the mounted folder, valid, status ok, naming the image
    assert len(run.records) == 1, run.logs[-4000:]
    rec = run.records[0]
    path = results / rec["run_id"] / "record.json"
    assert path.exists()
    on_disk = json.loads(path.read_text())
    assert on_disk == rec
    validate(on_disk)
    assert on_disk["status"] == "ok", on_disk["error"]
    assert on_disk["system"] == "calibrate" and on_disk["mode"] == "real"
    assert on_disk["provenance"]["container_image"] == image_id
    assert on_disk["config"]["results_dir"] == "/results"

    # non-root: the engine ran it as 10001, and the files it wrote are 10001's, in the host
    # user's group (setgid folder) and usable by that group (umask 002): a non-root host user
    # can read the record and append to records.jsonl.
    assert run.user.split(":")[0] == "10001"
    st = path.stat()
    assert st.st_uid == 10001 and st.st_gid == os.getgid()
    assert st.st_mode & stat.S_IRGRP, f"record.json is {oct(st.st_mode)}: unreadable for the host user"
    assert path.parent.stat().st_mode & stat.S_IWGRP
    assert (results / "records.jsonl").stat().st_mode & stat.S_IWGRP

    # no network; an environment made from nothing (no host variable, no secret)
    assert run.network == "none"
    assert f"MLSYS_BENCH_CONTAINER_IMAGE={image_id}" in run.env
    assert "WANDB_MODE=offline" in run.env
    assert not [e for e in run.env if e.startswith("WANDB_API_KEY")]
    assert "not-a-real-secret" not in json.dumps(on_disk)


@pytest.mark.container
def test_network_none_means_loopback_only(image_id):
    """In this image with network none, as uid 10001: only `lo`, and no route anywhere."""
    import docker

    cli = docker.from_env()
    probe = ("import os, socket\n"
             "s = socket.socket(); s.settimeout(2)\n"
             "try:\n    s.connect(('1.1.1.1', 53)); reach = 'yes'\n"
             "except OSError as e:\n    reach = 'no'\n"
             "print(os.getuid(), sorted(os.listdir('/sys/class/net')), reach)\n")
    out = cli.containers.run(image_id, entrypoint=["python", "-c", probe], network_mode="none",
                             user="10001", remove=True).decode().split()
    cli.close()
    assert out == ["10001", "['lo']", "no"]
