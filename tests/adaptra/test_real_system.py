"""ADAPTRA family through the harness in real mode: same training whatever the schedule and
comm path, and an injected rank kill ends as a failed record rather than a hang."""
from __future__ import annotations

import pytest

from bench.record import load_records
from bench.system_choice import choice_of
from tests.conftest import run_bench
from tests.support.inprocess import run_job

pytestmark = pytest.mark.real

SMALL = ["mode=real", "workload=pipeline_s4", "workload.num_microbatches=6", "workload.iterations=3",
         "workload.warmup_iterations=0", "workload.op_pad_s=0.002", "progress=false",
         "fault=link_delay", "fault.delay_s=0.005", "++system.num_delegates=3"]


def test_every_variant_trains_the_same_model(tmp_path):
    results = {s: run_job([f"system={choice_of(s)}", *SMALL], tmp_path / s) for s in ("1f1b", "zb", "zb_uncapped", "adaptra_cpu", "adaptra")}
    digests = {s: r.info["params_sha256"] for s, r in results.items()}
    assert len(set(digests.values())) == 1, digests  # bitwise-equal final parameters
    losses = {s: r.info["losses_last_iteration"] for s, r in results.items()}
    assert all(v == losses["zb"] for v in losses.values()), losses
    assert results["adaptra"].info["comm_paths"] == ["delegated"] * 3
    assert results["zb"].info["comm_paths"] == ["fifo"] * 3
    # N = 6 < 2S−1: the uncapped ZB stores more activations on stage 1 than the capped one
    peak = {s: results[s].info["peak_in_flight"] for s in ("zb", "zb_uncapped")}
    assert peak["zb_uncapped"] != peak["zb"], peak
    assert any("padded with sleep" in e for e in results["adaptra"].emulated)


def test_rank_kill_leaves_failed_record(tmp_path):
    proc = run_bench(["system=adaptra/zb", *SMALL[:-3], "fault=rank_kill", "fault.rank=2", "fault.at_iter=1",
                      f"results_dir={tmp_path}"])
    assert proc.returncode == 1, proc.stderr
    (rec,) = load_records(tmp_path)
    assert rec["status"] == "failed"
    assert "rank 2" in rec["error"] and "rank_kill" in rec["error"] and "\n" not in rec["error"]
