"""real.scenario=one_gpu (README "One GPU"): one process saves and reloads its training state on the job's
device (job.execution); ours and both DCP baselines give back the same bytes; the gpu preset
composes and, without CUDA, is refused in preflight in one line."""
from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from bench.config import compose_config
from bench.system_choice import choice_of
from bench.validate import typed_job
from impl.ckpt_recovery import one_gpu
from impl.ckpt_recovery.real_config import CkptRealKnobs
from impl.ckpt_recovery.system import CkptRecovery
from impl.common.api import ConfigError, JobContext
from impl.common.execution import Execution
from impl.common.storage.emulator import profile
from impl.common.workloads.pipeline import ModelShape

TINY = ModelShape(name="t", num_layers=2, hidden=64, heads=4, ffn_hidden=128, vocab=256, seq_len=16)
PRESET = ["experiment=gpu/ckpt_recovery"]


def _wl(**kw):
    base = dict(model=TINY, dtype="bf16", iterations=4, num_gpus=1, tp=1, pp=1, dp=1)
    return types.SimpleNamespace(**{**base, **kw})


def _knobs(**kw):
    return CkptRealKnobs(**{**dict(scenario="one_gpu", storage="local", ckpt_every=2, keep=1, step_s=0.05), **kw})


def test_ours_on_the_jobs_device_reloads_the_same_bytes(tmp_path):
    """Through the harness system: the device is job.execution's (cpu here), the reloaded state
    equals the saved one bit for bit (dtype included), the stall is the snapshot copy."""
    system = CkptRecovery(CkptRecovery.Config(policy="ckpt_recovery", real=_knobs(root=str(tmp_path))), "ckpt_recovery")
    job = JobContext("real", 0, "t", _wl(), "w", None, "h", None, "none", tmp_path, execution=Execution(device="cpu"))
    res = system.run(job)
    assert res.info["device"] == "cpu" and res.info["scenario"] == "one_gpu"
    assert res.info["bit_exact"] and res.info["param_dtype"] == "bfloat16"
    assert res.info["loaded_step"] in (2, 4)
    assert res.metrics["saves"].value >= 1 and res.metrics["t_load_s"].value > 0
    assert res.metrics["t_stall_s"].value < 1.0
    assert not os.listdir(tmp_path)  # the checkpoints were scratch


@pytest.mark.parametrize("policy", ["dcp_sync", "dcp_async"])
def test_dcp_baselines_reload_the_same_bytes(policy):
    o = one_gpu.run(policy, _wl(), _knobs(), 0, Execution(device="cpu"), profile("local"))
    assert o["loaded"]["bit_exact"] and o["saved"]["step"] == 4 and o["saved"]["saves"] == 2
    assert o["device"] == "cpu" and o["state_bytes"] == one_gpu.state_bytes(TINY, torch.bfloat16)


def test_the_reload_check_sees_a_changed_byte():
    state, metas = one_gpu.make_state(TINY, 0, torch.device("cpu"), torch.float32)
    other = {k: v.clone() for k, v in state.items()}
    next(iter(other.values())).view(-1)[0] += 1
    assert not all(torch.equal(other[k], v) for k, v in state.items())
    assert [m.name for m in metas] == list(state)


def test_preset_composes_per_system():
    for system in ("ckpt_recovery", "dcp_sync", "dcp_async"):
        job = typed_job(compose_config(PRESET + ["execution=cpu", f"system={choice_of(system)}"]))
        assert job.system.cfg.real.scenario == "one_gpu" and job.system.cfg.policy == system
        assert job.workload.num_gpus == 1 and job.execution.device == "cpu"
    # ~1 B parameters, ~10 B each
    n = sum(int(torch.Size(s).numel()) for _, s in one_gpu.param_names(job.workload.model))
    lo, hi = 1.0e9, 1.1e9
    assert lo <= n <= hi


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for hosts without CUDA")
def test_preset_is_refused_without_cuda_in_one_line():
    with pytest.raises(ConfigError, match="execution.device: cuda requested but no CUDA device") as e:
        typed_job(compose_config(PRESET))
    assert "\n" not in str(e.value)
    p = subprocess.run([sys.executable, "-m", "bench", *PRESET], capture_output=True, text=True, timeout=120)
    out = (p.stdout + p.stderr).strip().splitlines()
    assert p.returncode == 2 and len(out) == 1 and "cuda" in out[0], out


@pytest.mark.parametrize("override,msg", [
    (["system=ckpt_recovery/restart_all"], r"policy: 'restart_all' does not run real.scenario=one_gpu"),
    (["workload.tp=2", "workload.num_gpus=2"], r"real.scenario=one_gpu runs one process"),
    (["system.real.ckpt_every=9"], r"real.ckpt_every: 9 must be in 1..workload.iterations \(2\)"),
    (["system.real.scenario=x"], r"real.scenario: Invalid value 'x', expected one of \[recovery, one_gpu\]"),
    (["system.real.splits=7"], r"7"),
])
def test_bad_one_gpu_input_is_one_line(override, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        typed_job(compose_config(PRESET + ["execution=cpu", *override]))
    assert "\n" not in str(e.value)
