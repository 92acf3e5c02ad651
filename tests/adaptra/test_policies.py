"""The registered schedules and comm paths: what each name hands the sim and the runtime."""
from __future__ import annotations

import pytest

from impl.adaptra.policies import COMMS, SCHEDULES
from impl.adaptra.system import PipelineTraining
from impl.common.runtime.executor import COMMS as RUNTIME_COMMS
from impl.common.schedule.validate import validate_schedule


def test_every_real_comm_path_is_one_the_executor_runs():
    real = {name: path.runtime for name, path in COMMS.items() if path.runtime is not None}
    assert set(real.values()) <= set(RUNTIME_COMMS), real
    # latency (no queueing) exists only as the sim reference
    assert set(COMMS.names()) - set(real) == {"latency"}


@pytest.mark.parametrize("name", SCHEDULES.names())
def test_every_schedule_plans_a_valid_schedule(name):
    cfg = PipelineTraining.Config(schedule=name)
    S, N, t = 4, 8, [1.0] * 4
    sched, _ = SCHEDULES.get(name).plan(cfg, t, t, t, {(1, 2): 3.0}, S, N)
    assert validate_schedule(sched, S, N) is None  # raises ScheduleError at the first broken invariant


def test_only_the_delay_aware_schedule_replans_on_a_delay():
    cfg = PipelineTraining.Config()
    t = [1.0] * 4
    for name, sched in SCHEDULES.items():
        quiet, _ = sched.plan(cfg, t, t, t, {}, 4, 8)
        slow, _ = sched.plan(cfg, t, t, t, {(1, 2): 3.0}, 4, 8)
        assert (quiet != slow) == sched.delay_aware, name
