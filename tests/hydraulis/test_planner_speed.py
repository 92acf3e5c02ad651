"""Planner wall time (pytest-benchmark; `--benchmark-enable` to time, otherwise each runs once
as a correctness test). S1: 32B on 64 GPUs, G = 200K; S5: 32B on 1024 GPUs, G = 1.6M (slow)."""
from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from impl.common.workloads.varlen import VarlenWorkload
from impl.hydraulis.batches import step_batches
from impl.hydraulis.cost.strategy import OptLayout, load_cost_data
from impl.hydraulis.sim import SimEnv, build_pool, cost_spec
from impl.hydraulis.step_plan import check_plan, plan_step
from impl.hydraulis.system import Hydraulis

from .conftest import hardware


def _setup(workload: str, opt: OptLayout):
    d = OmegaConf.load(f"conf/workload/{workload}.yaml")
    wl = dataclasses.replace(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(VarlenWorkload), d)), steps=1)
    system = Hydraulis(Hydraulis.Config(), "hydraulis")
    env = SimEnv(wl, hardware("a800-80g"), system, cost_spec(system), load_cost_data())
    pool, _, mem = build_pool(env, step_batches(wl, 1, 2), opt)
    lengths = step_batches(wl, 0, 1)[0].lengths.tolist()
    return env, pool, mem, lengths


def _bench(benchmark, workload, opt):
    env, pool, mem, lengths = _setup(workload, opt)
    plan = benchmark(lambda: plan_step(lengths, pool.candidates, **env.plan_kwargs(0)))
    check_plan(lengths, plan, num_gpus=env.n, mem=mem)
    return plan


def test_plan_time_s1(benchmark):
    plan = _bench(benchmark, "hydraulis_32b_64gpu_cc", OptLayout(4, 16, 1))
    assert plan.plan_time_s < plan.predicted_ms / 1e3  # well under the simulated step (README: ratio)


@pytest.mark.slow
def test_plan_time_s5(benchmark):
    plan = _bench(benchmark, "hydraulis_32b_1024gpu_cc", OptLayout(64, 16, 1))
    assert plan.plan_time_s > 0
