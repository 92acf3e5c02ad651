"""Multi-node through torch's own launcher: two torchrun "nodes" on localhost (2 ranks each)
run ADAPTRA's real pipeline (delegated data plane on, a delayed link) through ``-m bench`` and
train exactly what the spawned job trains; only global rank 0 writes a record."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid

import pytest

from bench.record import load_records
from tests.conftest import REPO, run_bench
from tests.adaptra.test_real_system import SMALL

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]

# Equality of the two launches is the point here, not the host's quiet: the validity rule that
# counts the other node's ranks as this job is tested in tests/bench/test_host_load.py.
JOB = ["system=adaptra/adaptra", *SMALL, "validity.max_foreign_cpu_frac=null"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_nodes(args: list[str], nnodes: int = 2, nproc: int = 2, timeout: float = 240) -> list:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("WANDB_MODE", "disabled")
    endpoint, run_id = f"127.0.0.1:{_free_port()}", f"mlsys-test-{uuid.uuid4().hex[:8]}"
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
                               "--nproc-per-node", str(nproc), "--node-rank", str(n), "--rdzv-backend", "c10d",
                               "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--max-restarts", "0",
                               "-m", "bench", *args],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in range(nnodes)]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def test_two_torchrun_nodes_train_like_the_spawned_job(tmp_path):
    spawned = run_bench([*JOB, f"results_dir={tmp_path / 'spawned'}"])
    assert spawned.returncode == 0, spawned.stderr[-2000:]
    (ref,) = load_records(tmp_path / "spawned")

    nodes = _torchrun_nodes([*JOB, f"results_dir={tmp_path / 'torchrun'}"])
    for rc, _, stderr in nodes:
        assert rc == 0, stderr[-3000:]
    (rec,) = load_records(tmp_path / "torchrun")  # exactly one record: global rank 0's
    lines = (tmp_path / "torchrun" / "records.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["run_id"] == rec["run_id"]
    runs = [p.name for p in (tmp_path / "torchrun").iterdir() if p.is_dir() and p.name != "_hydra"]
    assert runs == [rec["run_id"]]
    assert sum("iteration_time_s" in stdout for _, stdout, _ in nodes) == 1  # one summary table

    assert rec["status"] == ref["status"] == "ok", (rec.get("invalid_reasons"), ref.get("invalid_reasons"))
    assert rec["info"]["comm_paths"] == ref["info"]["comm_paths"] == ["delegated"] * 3
    assert rec["info"]["losses_last_iteration"] == ref["info"]["losses_last_iteration"]
    assert rec["info"]["params_sha256"] == ref["info"]["params_sha256"]
    assert rec["metrics"]["final_loss"]["value"] == ref["metrics"]["final_loss"]["value"]
