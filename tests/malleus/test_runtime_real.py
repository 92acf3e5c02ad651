"""The DP x PP gloo runtime: any sequence of plans trains exactly like one process.

One 4-rank run switches plan every iteration (uniform -> non-uniform layers and
micro-batches -> mirror -> a 1-stage + 3-stage pipeline -> a suspended rank), migrating
parameters and Adam state each time. Checks: every migrated unit bitwise equal to its old
holders' copy, losses equal the single-process reference on the same global batches, final
parameters match the reference, replicas identical, consumed-sample ranges continuous.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from impl.common.models.tiny_gpt import reference_train
from impl.common.parallel.plan import Group, Plan, PipelinePlan, uniform_plan, validate_plan
from impl.common.runtime.hybrid import FixedPlans, HybridRunConfig, run_hybrid
from impl.common.workloads.pipeline import ModelShape

pytestmark = pytest.mark.real

SHAPE = ModelShape(name="gpt-tiny", num_layers=8, hidden=32, heads=4, ffn_mult=4, vocab=64, seq_len=16)
M = 8


def _plans():
    u = uniform_plan(4, 1, 2, 1, 2, 8, M)
    g = [Group((d,), d) for d in range(4)]
    p1 = Plan(4, 1, 1, 8, M, u.groups, (PipelinePlan(u.pipelines[0].groups, (2, 6), 3),
                                        PipelinePlan(u.pipelines[1].groups, (4, 4), 5)), (), "p1")
    p2 = Plan(4, 1, 1, 8, M, u.groups, (PipelinePlan(u.pipelines[0].groups, (4, 4), 5),
                                        PipelinePlan(u.pipelines[1].groups, (6, 2), 3)), (), "p2")
    # pipeline 0 = GPU 3 alone; pipeline 1 = GPUs 0, 2, 1 (three stages)
    p3 = Plan(4, 1, 1, 8, M, (g[3], g[0], g[2], g[1]), (PipelinePlan((0,), (8,), 2),
                                                         PipelinePlan((1, 2, 3), (3, 3, 2), 6)), (), "p3")
    # GPU 2 suspended: pipeline 0 = GPUs 1, 0; pipeline 1 = GPU 3
    p4 = Plan(4, 1, 1, 8, M, (g[1], g[0], g[3]), (PipelinePlan((0, 1), (5, 3), 4), PipelinePlan((2,), (8,), 4)), (2,), "p4")
    for p in (u, p1, p2, p3, p4):
        validate_plan(p)
    return [u, p1, p2, p3, p4, u]


def test_any_plan_sequence_trains_like_one_process():
    plans = _plans()
    iters = len(plans)
    cfg = HybridRunConfig(SHAPE, 4, 1, M, iters, seed=3, initial_plan=plans[0].to_dict(), optimizer="adam", lr=1e-2,
                          bucket_bytes=64 * 1024, collect_params=True, timeout_s=240)
    out = run_hybrid(cfg, FixedPlans([p.to_dict() for p in plans]))
    ref = reference_train(SHAPE, 1, M, iters, 3, "adam", 1e-2)
    np.testing.assert_allclose(np.array(out["losses"]), np.array(ref.losses), rtol=1e-5)
    # every plan ran, every switch migrated state and checked it bitwise
    assert [Plan.from_dict(p).signature() for p in out["plans"]] == [p.signature() for p in plans]
    assert len(out["migrations"]) == iters - 1 and out["migration_checks"] > 0
    assert all(m["rounds"] >= 1 for m in out["migrations"])
    # parameters after training equal the reference (replicas were checked identical). The
    # attention key bias has a mathematically zero gradient (softmax ignores it), so its
    # gradient is rounding noise that Adam normalises to ~lr steps: atol well under lr.
    for name, t in ref.params.items():
        torch.testing.assert_close(out["params"][name], t, rtol=1e-4, atol=2e-4)
    # consumed-sample counter: contiguous ranges, M samples per iteration
    flat = [r for it in out["consumed"] for r in it]
    assert flat[0][0] == 0 and all(b[0] == a[1] for a, b in zip(flat, flat[1:])) and flat[-1][1] == M * iters


def test_iteration_time_is_last_rank_even_when_rank0_suspended():
    """Rank 0 suspended (it only probes): the iteration time must still cover the slowest
    active rank's work, not collapse to rank 0's probe."""
    m = 4
    u = uniform_plan(4, 1, 2, 1, 2, 8, m)
    g = [Group((d,), d) for d in range(4)]
    # GPU 0 suspended: pipeline 0 = GPU 1 alone (8 layers), pipeline 1 = GPUs 2, 3
    susp = Plan(4, 1, 1, 8, m, (g[1], g[2], g[3]), (PipelinePlan((0,), (8,), 2), PipelinePlan((1, 2), (4, 4), 2)),
                (0,), "susp0")
    validate_plan(susp)
    plans = [u, susp, susp]
    cfg = HybridRunConfig(SHAPE, 4, 1, m, len(plans), seed=0, initial_plan=u.to_dict(), layer_fwd_pad_s=0.002,
                          layer_bwd_pad_s=0.004, verify_migration=False, timeout_s=120)
    out = run_hybrid(cfg, FixedPlans([p.to_dict() for p in plans]))
    seen_susp = 0
    for t, r in zip(out["iteration_times_s"], out["reports"]):
        assert t == r["iteration_time_s"] == max(r["rank_times_s"])
        assert t >= max(c for c in r["compute_s"] if c is not None)
        assert all(t >= rt for rt in r["rank_times_s"])
        if r["suspended"] == [0]:
            seen_susp += 1
            assert r["probe_s"][0] is not None and r["compute_s"][1] > 0
            # the reported time covers rank 1's whole iteration, not rank 0's probe
            assert t >= r["rank_times_s"][1] >= r["compute_s"][1]
    assert seen_susp == 2


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA devices")
def test_on_four_gpus_the_same_plan_sequence_trains_like_one_process_over_nccl():
    from impl.common.execution import resolve, set_current, take_notes

    plans = _plans()
    set_current(resolve())
    try:
        take_notes()
        cfg = HybridRunConfig(SHAPE, 4, 1, M, len(plans), seed=3, initial_plan=plans[0].to_dict(), optimizer="adam",
                              lr=1e-2, bucket_bytes=64 * 1024, collect_params=True, timeout_s=240)
        out = run_hybrid(cfg, FixedPlans([p.to_dict() for p in plans]))
        assert [p.backend for p in take_notes()] == ["nccl"]
    finally:
        set_current(None)
    ref = reference_train(SHAPE, 1, M, len(plans), 3, "adam", 1e-2)
    np.testing.assert_allclose(np.array(out["losses"]), np.array(ref.losses), rtol=1e-4)
    assert out["migration_checks"] > 0
