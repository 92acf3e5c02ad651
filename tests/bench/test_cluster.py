"""Cluster paths without a cluster: submitit's local executor (each job its own process, as on
Slurm), the Slurm preset, torchrun's rendezvous from a Slurm-like environment, real jobs from
parallel launchers and their host-load accounting."""
from __future__ import annotations

import json
import os

import pytest

from bench.config import compose_config
from bench.record import load_records, validate
from impl.common.api import ConfigError
from impl.common.runtime.slurm import first_host, rendezvous, torchrun_command
from tests.conftest import TEST_ARGS, run_bench

SUBMITIT = "hydra_plugins.hydra_submitit_launcher"


def test_submitit_local_sweep_writes_both_records_with_job_ids(tmp_path):
    pytest.importorskip(SUBMITIT, reason="needs .[dev] (hydra-submitit-launcher)")
    proc = run_bench(["--multirun", "hydra/launcher=submitit_local", "system=echo_a,echo_b", *TEST_ARGS,
                      f"results_dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = sorted(load_records(tmp_path), key=lambda r: r["system"])
    assert [r["system"] for r in recs] == ["echo_a", "echo_b"]
    for r in recs:
        validate(r)
        assert r["status"] == "ok"
    scheds = [r["provenance"]["scheduler"] for r in recs]
    assert {s["kind"] for s in scheds} == {"submitit_local"}
    ids = {s["job_id"] for s in scheds}
    assert len(ids) == 2 and all(i.isdigit() for i in ids), scheds  # one process per job
    # submitit's own log folder names each job by the id the record carries
    sweep = recs[0]["sweep"]
    assert {p.name for p in (tmp_path / "_hydra" / sweep.split("/_hydra/")[1] / ".submitit").iterdir()} >= ids
    # the sweep's side-by-side table, from the launching process once both jobs are back
    table = proc.stdout[proc.stdout.index("== experiment=adhoc"):]
    assert "echo_a (baseline)" in table and "echo_b" in table and "0.50x" in table


def test_slurm_preset_composes_for_submitit():
    pytest.importorskip(SUBMITIT, reason="needs .[dev] (hydra-submitit-launcher)")
    cfg = compose_config(["hydra/launcher=slurm", "hydra.launcher.partition=gpu"], return_hydra_config=True)
    ln = cfg.hydra.launcher
    assert ln._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (ln.partition, ln.nodes, ln.gpus_per_node, ln.tasks_per_node) == ("gpu", 1, 8, 1)
    assert ln.timeout_min > 0 and "container-image" in ln.additional_parameters


SLURM_ENV = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": "1",
             "SLURM_JOB_NODELIST": "gpu[007-008]", "SLURM_GPUS_ON_NODE": "4", "SLURM_PROCID": "1"}


def test_torchrun_rendezvous_comes_from_slurm_environment(monkeypatch):
    for k in list(os.environ):
        if k.startswith("SLURM_") or k == "MLSYS_RDZV_PORT":
            monkeypatch.delenv(k)
    for k, v in SLURM_ENV.items():
        monkeypatch.setenv(k, v)
    rdzv = rendezvous()
    assert (rdzv.nnodes, rdzv.node_rank, rdzv.nproc_per_node) == (2, 1, 4)
    assert rdzv.endpoint == "gpu007:29500" and rdzv.run_id == "slurm-4242"
    monkeypatch.setenv("MLSYS_RDZV_PORT", "31000")
    cmd = torchrun_command(["system=adaptra/adaptra", "mode=real"])
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and cmd[-4:] == ["-m", "bench", "system=adaptra/adaptra", "mode=real"]
    args = dict(zip(cmd[3:-4:2], cmd[4:-4:2]))
    assert args == {"--nnodes": "2", "--nproc-per-node": "4", "--rdzv-backend": "c10d",
                    "--rdzv-endpoint": "gpu007:31000", "--rdzv-id": "slurm-4242", "--max-restarts": "0"}
    monkeypatch.setenv("SLURM_NTASKS", "8")  # srun started one task per GPU, not per node
    with pytest.raises(ConfigError, match=r"^SLURM_NTASKS: 8 tasks on 2 nodes"):
        rendezvous()


@pytest.mark.parametrize("nodelist, host", [("gpu[007-009,012],cpu1", "gpu007"), ("node3", "node3"),
                                            ("a100-[01-04]", "a100-01"), ("n1,n2", "n1")])
def test_first_host_of_a_slurm_hostlist(nodelist, host):
    assert first_host(nodelist) == host


def test_rendezvous_outside_slurm_is_one_line():
    with pytest.raises(ConfigError, match=r"^SLURM_JOB_ID: not set"):
        rendezvous({})


BURN_S = 2.5


@pytest.mark.real
def test_concurrent_real_jobs_start_and_count_each_other_as_foreign(tmp_path):
    """Two real jobs of one joblib sweep run at once, each starting local ranks (launch()) that
    burn half the cores: each job's own CPU is its ranks, the other job's is foreign, so on 2
    cores each takes ~50% of the other's machine and both records are invalid. (The same sweep
    through hydra/launcher=submitit_local runs too; left out here for CI time: its jobs are
    plain subprocesses, which the sim test above already covers.)"""
    launcher = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    n = os.cpu_count() or 1
    ranks = max(1, n // 2)
    proc = run_bench(["--multirun", *launcher, "system=echo_a,echo_b", "mode=real", f"+system.ranks={ranks}",
                      f"+system.burn_s={BURN_S}", *TEST_ARGS, f"results_dir={tmp_path}"], timeout=300)
    recs = load_records(tmp_path)
    assert len(recs) == 2, proc.stderr[-3000:]
    for r in recs:
        assert r["error"] is None, r["error"]  # the ranks started (from a loky worker too)
        assert r["info"]["rank_pids"] and len(r["info"]["rank_pids"]) == ranks
        assert r["status"] == "invalid", json.dumps(r["host_load"])
        assert r["invalid_reasons"][0].startswith("host contended")
        # the job's own ranks are counted as its own, not foreign
        assert r["host_load"]["own_cpu_s"] >= 0.9 * BURN_S * ranks, r["host_load"]
