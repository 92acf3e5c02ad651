"""Multi-process save (ours sync and async, DCP sync and async) and resharded load on gloo."""
from __future__ import annotations

import pytest

from impl.ckpt_recovery.bench import BenchSpec, load_phase, save_phase
from impl.common.checkpoint.layout import StagePlan
from impl.common.runtime.launch import launch
from impl.common.workloads.pipeline import ModelShape

SHAPE = ModelShape(name="ckpt-real-test", num_layers=4, hidden=64, heads=4, ffn_hidden=128, vocab=256, seq_len=64)


@pytest.mark.real
def test_save_then_reshard_load_on_survivors(tmp_path):
    spec = BenchSpec(SHAPE, seed=3, root=str(tmp_path), splits=8, saves=2, compute_s=0.05,
                     systems=("elastor_sync", "elastor", "dcp_sync", "dcp_async"),
                     old=((StagePlan((0, 1), (0, 2)), StagePlan((2, 3), (2, 4))),),
                     new=((StagePlan((0, 1), (0, 3)), StagePlan((2,), (3, 4))),))
    saved = launch(save_phase, 4, (spec,), label="ckpt save", timeout_s=300).results
    assert all(len(r["dcp_sync"]["stall_s"]) == 2 for r in saved)
    log = saved[0]["elastor_log"]
    assert log["saves"] >= 1 and log["committed_steps"]
    for system, world in (("elastor_sync", 3), ("elastor", 3), ("dcp_sync", 2), ("dcp_async", 2)):
        res = launch(load_phase, world, (spec, system), label=f"ckpt load {system}", timeout_s=300).results
        assert all(r["bit_exact"] for r in res), (system, res)
        if system.startswith("elastor"):
            assert all(r["read_amplification"] < 1.2 for r in res)
