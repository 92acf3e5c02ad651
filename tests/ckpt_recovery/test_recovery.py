"""The recovery loop's decisions: re-plan on every survivor vs
the baselines' homogeneous fit, a kill in the middle of a save, bad input to the real mode."""
from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest

from impl.ckpt_recovery.real import check_real
from impl.ckpt_recovery.real_config import CkptRealKnobs
from impl.ckpt_recovery.recovery import replan as R
from impl.ckpt_recovery.recovery.supervisor import run, timeline
from impl.ckpt_recovery.recovery.trainer import KillAt, StageModel, TrainSpec, _peers, full_metas
from impl.common.api import ConfigError
from impl.common.checkpoint.layout import pipeline_layout
from impl.common.workloads.hybrid import HybridModelShape, HybridWorkload

from .helpers import SHAPE

SHAPE32 = dataclasses.replace(SHAPE, seq_len=32)
CLUSTER = R.Cluster(num_gpus=4, gpus_per_node=2, tp=2, pp=2, num_layers=4, micro_batches=4, alpha=(1.0, 2.0))


def test_replan_uses_every_survivor_and_the_baseline_fit_uses_two():
    metas = full_metas(SHAPE32, 0)
    for lost in ([3], [2], [0]):
        lay = R.replan(CLUSTER, lost, metas)
        assert lay.world == 3 and sorted(lay.device_of) == sorted(set(range(4)) - set(lost))
        # TP2 | TP1 groups; the TP1 group (twice as slow per layer) gets the fewer layers
        sizes = {len(s.ranks): s.layers[1] - s.layers[0] for s in lay.stages}
        assert sizes == {1: 1, 2: 3} and lay.micro_batches == 4  # global batch unchanged
        assert R.homogeneous(CLUSTER, lost, metas, SHAPE32.heads).world == 2
    # a budget no layout of the survivors meets: one line naming the knob
    with pytest.raises(ConfigError, match=r"real.mem_budget: the re-planned layout .* over the budget 0.3"):
        R.replan(dataclasses.replace(CLUSTER, mem_budget=0.3), [3], metas)


def test_stage_state_is_what_the_checkpoint_layout_says_the_rank_holds():
    metas = full_metas(SHAPE32, 0)
    by = {m.name: m for m in metas}
    stages = R.replan(CLUSTER, [3], metas).stages
    lay = pipeline_layout(metas, [list(stages)], 4)
    sp = TrainSpec(SHAPE32, 0, stages, steps=1, global_batch=8, micro_batches=4, root="/nonexistent")
    for rank in range(3):
        sm = StageModel(sp, rank, {})
        own = lay.ranks[rank]
        assert list(sm.local) == [k for k in (m.name for m in metas) if k in own]
        for k, v in sm.local.items():
            m, (_, g) = by[k], own[k]
            want = list(m.shape) if m.dim is None else [n // g if d == m.dim else n for d, n in enumerate(m.shape)]
            assert list(v.shape) == want, k


def test_pipeline_peers_across_tp_degrees():
    stages = R.replan(CLUSTER, [3], full_metas(SHAPE32, 0)).stages  # [TP1 r0 | TP2 r1,2]
    sp = TrainSpec(SHAPE32, 0, stages, steps=1, global_batch=8, micro_batches=4, root="/x")
    assert _peers(sp, 0, 0) == (None, [1, 2], 1, [])  # one sender feeds both TP ranks
    assert _peers(sp, 1, 0) == (0, [], None, [0])
    assert _peers(sp, 1, 1) == (0, [], None, [])  # its input grad is rank 1's copy


def _system(policy="ckpt_recovery", **kw):
    return SimpleNamespace(cfg=SimpleNamespace(policy=policy, real=CkptRealKnobs(**kw)))


def _wl(**kw):
    base = dict(model=HybridModelShape(name="t", num_layers=4, hidden=64, heads=4, ffn_hidden=128, vocab=256, seq_len=32),
                num_gpus=4, gpus_per_node=2, dp=1, tp=2, pp=2, global_batch_size=8, micro_batch_size=2, iterations=12)
    base.update(kw)
    return HybridWorkload(**base)


def test_real_mode_bad_input_one_line_each():
    fault = SimpleNamespace(kind="gpu_loss", ranks=[3], at_step=7, mid_save=False, seed=0)
    check_real(_system(), _wl(), None, fault)
    cases = [(_system("ucp_like"), _wl(), fault, r"policy: 'ucp_like' is sim only"),
             (_system(), _wl(dp=2, num_gpus=8), fault, r"workload.dp: the real trainer runs one pipeline"),
             (_system(splits=3), _wl(), fault, r"S=3 is not divisible by TP degree 2"),
             (_system(storage="s3"), _wl(), fault, r"real.storage: unknown 's3'"),
             (_system(), _wl(), SimpleNamespace(kind="node_loss", node=1), r"fault.kind: real mode injects gpu_loss"),
             (_system(), _wl(), SimpleNamespace(**{**vars(fault), "ranks": [4]}),
              r"fault.ranks: real mode kills one rank of 0..3, got \[4\]"),
             (_system(ckpt_every=3), _wl(), SimpleNamespace(**{**vars(fault), "at_step": 2}),
              r"fault.at_step: 2 must lie after the first save \(step 3\)")]
    for system, wl, f, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            check_real(system, wl, None, f)


@pytest.mark.real
@pytest.mark.parametrize("backend", ["elastor", "dcp_async", "dcp_async_process"])
def test_kill_in_the_middle_of_a_save_recovers_from_the_previous_commit(tmp_path, backend):
    metas = full_metas(SHAPE32, 1)
    relayout = (lambda lost: R.replan(CLUSTER, lost, metas)) if backend == "elastor" else \
        (lambda lost: R.homogeneous(CLUSTER, lost, metas, SHAPE32.heads))
    sp = TrainSpec(SHAPE32, 1, R.uniform_stages(2, 2, 4), steps=8, global_batch=8, micro_batches=4, root=str(tmp_path),
                   backend=backend, ckpt_every=2, splits=8, kill=KillAt(rank=2, at_step=5, mid_save=True))
    # The injected kill is reported, not detected: the heartbeat watchdog only has to stay out of
    # the way while DCP's checkpoint daemon starts (seconds on a loaded 2-core host, beyond 10 s).
    o = run(sp, relayout, hb_timeout_s=60.0)
    k = o.before.kill
    assert k["mid_save"] and k["fail_step"] >= 5 and k["fail_step"] in o.before.saves  # killed with a save in flight
    start = o.results[0]["start_step"]
    assert start not in (k["fail_step"],) and start < k["fail_step"]
    # the previous commit, not the interrupted save
    assert start == max(o.committed_on_disk) >= max(s for s, _ in o.before.commits)
    assert sorted(o.losses()) == list(range(8))
    # ours trains on the 3 survivors, the DCP baseline on the 2 of its rectangular mesh
    assert timeline(o)["ranks_after"] == (3 if backend == "elastor" else 2)
    # every saver (ours, or DCP's checkpoint daemon) was reported and is gone: none of the failed
    # launch's savers can commit after the loss
    import psutil

    for w, world in ((o.before, 4), (o.after, len(o.results))):
        if backend != "dcp_async":
            assert len(w.savers) == world, w.savers
        for pid in w.savers.values():
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid


@pytest.mark.parametrize("point", ["after_manifest", "after_rename", "mid_pointer"])
def test_a_restart_after_a_crashed_commit_saves_that_step_again(tmp_path, point):
    from impl.common.checkpoint.layout import cut_state
    from impl.common.checkpoint.save import save_serial
    from impl.common.checkpoint.store import CheckpointStore

    from .helpers import tp2pp2, trained_state

    class Killed(BaseException):
        pass

    state, metas = trained_state(seed=0)
    lay = tp2pp2(metas)
    locs = {r: cut_state(state, metas, own) for r, own in lay.ranks.items()}
    save_serial(CheckpointStore(tmp_path), 2, metas, lay, 8, locs, {"consumed_samples": 2})

    def kill(p):
        if p == point:
            raise Killed(p)

    with pytest.raises(Killed):
        save_serial(CheckpointStore(tmp_path, kill=kill), 4, metas, lay, 8, locs, {"consumed_samples": 4})
    fresh = CheckpointStore(tmp_path)  # what the relaunched rank 0 does before any save
    fresh.clear_stale()
    assert fresh.drop_unpointed() == ([4] if point != "after_manifest" else [])
    assert fresh.open().step == 2 and not any(d.startswith(".tmp-") for d in os.listdir(tmp_path))
    save_serial(fresh, 4, metas, lay, 8, locs, {"consumed_samples": 4})  # the resumed job reaches step 4 again
    assert fresh.latest() == 4


def test_watchdog_sees_a_gone_process_and_a_silent_one():
    import subprocess
    import time

    from impl.ckpt_recovery.recovery.supervisor import Watch

    gone = subprocess.Popen(["true"])
    gone.wait()
    w = Watch(hb_timeout_s=0.5, target_steps=10)
    w.on_report(0, ("pid", os.getpid(), 0.0))
    w.on_report(1, ("pid", gone.pid, 0.0))
    assert w.check() == f"rank 1 process gone (pid {gone.pid})"
    w.on_report(1, ("done", 1))  # a rank that finished is not a loss
    w.on_report(0, ("hb", 0, 3, 0.0, 0.1))
    assert w.check() is None
    w.hb[0] = (3, time.monotonic() - 2.0)  # no heartbeat for 2 s
    assert w.check().startswith("rank 0 silent for 2.0 s (heartbeat timeout 0.5 s)")
    w.hb[0] = (10, time.monotonic() - 2.0)  # past its last step: finishing, not failing
    assert w.check() is None
