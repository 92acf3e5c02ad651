"""Checkpoint-recovery harness system: presets compose, policies and modes, bad input is one
line naming the field (the harness contract)."""
from __future__ import annotations

import pytest

from bench.config import compose_config
from bench.system_choice import choice_of
from bench.validate import typed_job
from impl.ckpt_recovery.system import POLICIES, CkptRecovery
from impl.common.api import ConfigError

S1 = ["experiment=ckpt_recovery/s1"]


def _job(overrides):
    return typed_job(compose_config(overrides))


@pytest.mark.parametrize("preset", ["s1", "s2", "s3", "s4", "s5", "s6"])
def test_presets_compose_and_pass_preflight(preset):
    job = _job([f"experiment=ckpt_recovery/{preset}"])
    assert isinstance(job.system, CkptRecovery) and job.system.cfg.policy == "ckpt_recovery"
    assert job.workload.kind == "hybrid"
    assert job.fault.kind in ("gpu_loss", "node_loss", "none")


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_has_a_system_yaml(policy):
    job = _job(S1 + [f"system={choice_of(policy)}"])
    assert job.system.cfg.policy == policy and job.system_name == policy
    assert "sim" in job.system.modes


def test_unknown_policy():
    with pytest.raises(ConfigError, match=r"system.policy: unknown value 'x'"):
        CkptRecovery(CkptRecovery.Config(policy="x"), "x")


def test_baselines_without_real_mode_say_so():
    with pytest.raises(ConfigError, match="does not run in mode 'real'"):
        _job(S1 + ["system=ckpt_recovery/gemini_like", "mode=real"])


@pytest.mark.parametrize("override,msg", [
    (["system.sim.storage=tape"], r"storage: unknown profile 'tape' \(one of: nas5, nas20, nvme, network\)"),
    (["system.sim.storage_profiles=[nas5,hdfs]"], r"storage: unknown profile 'hdfs'"),
    (["fault.ranks=[40]"], r"fault.ranks: rank 40 does not exist \(the workload has 32 GPUs: 0..31\)"),
    (["fault.ranks=[1,1]"], r"fault.ranks: \[1, 1\] lists a rank twice"),
    (["fault.ranks=" + str(list(range(32))).replace(" ", "")], r"fault.ranks: 32 lost GPUs leave no survivor of 32"),
    (["fault.at_step=-1"], r"fault.at_step must be >= 0, got -1"),
    (["experiment=ckpt_recovery/s3", "fault.node=8"], r"fault.node: node 8 does not exist \(the workload has 8 nodes: 0..7\)"),
    (["system.sim.splits=6"], r"system.sim.splits: S=6 is not divisible by TP degree 4"),
    (["experiment=ckpt_recovery/s5", "system.sim.failures=fault"], r"fault.kind: sim.failures=fault needs a gpu_loss or node_loss fault, got 'none'"),
    (["system.sim.failures=poisson"], r"fault.kind: sim.failures=poisson draws its own failures"),
    (["system.sim.repair_h=[6.0,2.0]"], r"system.sim.repair_h: needs \[lo, hi\] hours"),
    (["system.sim.failures=weekly"], r"system.sim.failures: unknown 'weekly'"),
    (["workload=malleus_cpu_dp2pp2"], r"fault.ranks: rank 5 does not exist"),
])
def test_bad_input_is_one_line(override, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        _job((override if override[0].startswith("experiment=") else S1 + override))
    assert "\n" not in str(e.value)
