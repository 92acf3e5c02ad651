"""Reproducible resume through the real recovery loop: same-layout resume
is bitwise the uninterrupted run; a cross-layout resume is bitwise a fault-free run loading the
same checkpoint into that layout (and close to the old layout's curve)."""
from __future__ import annotations

import dataclasses
import math

import pytest

from impl.ckpt_recovery.recovery import replan as R
from impl.ckpt_recovery.recovery.supervisor import run, timeline
from impl.ckpt_recovery.recovery.trainer import KillAt, TrainSpec, full_metas

from .helpers import SHAPE

SHAPE32 = dataclasses.replace(SHAPE, seq_len=32)
CLUSTER = R.Cluster(num_gpus=4, gpus_per_node=2, tp=2, pp=2, num_layers=4, micro_batches=4, alpha=(1.0, 2.0))
STEPS = 9


def spec(root, **kw) -> TrainSpec:
    base = dict(shape=SHAPE32, seed=5, stages=R.uniform_stages(2, 2, 4), steps=STEPS, global_batch=8, micro_batches=4,
                root=str(root), ckpt_every=2, splits=8, keep=8)
    base.update(kw)
    return TrainSpec(**base)


def committed_before_kill(o) -> int:
    """The step the relaunch must resume from: the newest on disk when it started (at least
    the newest commit rank 0 reported before the kill)."""
    assert max(o.committed_on_disk) >= max(s for s, _ in o.before.commits)
    return max(o.committed_on_disk)


@pytest.mark.real
def test_same_layout_resume_is_bitwise_the_uninterrupted_run(tmp_path):
    ref = run(spec(tmp_path / "ref"))
    assert ref.after is None and sorted(ref.losses()) == list(range(STEPS))
    metas = full_metas(SHAPE32, 5)
    o = run(spec(tmp_path / "kill", kill=KillAt(rank=3, at_step=7)), lambda lost: R.same(CLUSTER, metas))
    start = o.results[0]["start_step"]
    assert o.before.kill["rank"] == 3 and o.before.kill["fail_step"] == 7
    assert start == committed_before_kill(o) and 0 < start < 7
    assert o.losses() == ref.losses()  # every step, float for float
    t = timeline(o)
    assert t["ranks_after"] == 4 and t["committed_step"] == start and t["t_lost_s"] > 0


@pytest.mark.real
def test_cross_layout_resume_equals_a_fault_free_run_from_that_checkpoint(tmp_path):
    metas = full_metas(SHAPE32, 5)
    o = run(spec(tmp_path, kill=KillAt(rank=3, at_step=7)), lambda lost: R.replan(CLUSTER, lost, metas))
    start = o.results[0]["start_step"]
    assert start == committed_before_kill(o)
    # the planner's layout on the 3 survivors: every one of them trains
    assert len(o.results) == 3 and o.relayout.how == "replan"
    assert [len(s.ranks) for s in o.relayout.stages] == [1, 2] and sorted(o.relayout.device_of) == [0, 1, 2]
    # a fault-free run that loads the same committed step into the same layout (saving nothing)
    free = run(spec(tmp_path, stages=o.relayout.stages, resume=True, resume_step=start, ckpt_every=10_000))
    assert free.results[0]["start_step"] == start
    after = {s: v for s, v in o.losses().items() if s >= start}
    assert after == free.losses()
    # and, reduction order aside, the old layout's curve
    ref = run(spec(tmp_path / "ref", ckpt_every=10_000))
    for s, v in after.items():
        assert math.isclose(v, ref.losses()[s], rel_tol=1e-5), (s, v, ref.losses()[s])
