"""LobRA sim through the System: a small paper-scale case (7B, 8 GPUs, 2 tasks), determinism,
ordering, whole-job checks."""
import dataclasses

import pytest
from omegaconf import OmegaConf

from bench.validate import typed_hardware, typed_workload
from impl.common.api import ConfigError
from impl.lobra import datasets
from impl.lobra.sim import simulate
from impl.lobra.system import LobRA


@pytest.fixture(scope="module")
def job():
    wl = typed_workload(OmegaConf.create(datasets.workload_yaml("llama2-7b", 8, ["dolly", "MeetingBank"], steps=2)))
    for t in wl.tasks:
        t.batch_seqs = 24
    hw = typed_hardware(OmegaConf.load("conf/hardware/a100-40g.yaml"))
    return wl, hw


class _Fault:
    kind = "none"


def system(**kw):
    cfg = LobRA.Config(**kw)
    cfg.sim.homogeneous = [4, 1]
    cfg.keep_max = 8
    cfg.plan_time_limit_s = 1.0
    return LobRA(cfg, kw.get("policy", "lobra"))


def test_lobra_below_task_fused_and_deterministic(job):
    wl, hw = job
    s = system()
    s.check("sim", wl, hw, _Fault())
    m1, info = simulate(s, wl, hw, 0)
    m2, _ = simulate(s, wl, hw, 0)
    assert m1["gpu_seconds"].value == m2["gpu_seconds"].value
    fused, _ = simulate(system(policy="task_fused"), wl, hw, 0)
    seq, _ = simulate(system(policy="task_sequential"), wl, hw, 0)
    assert m1["gpu_seconds"].value < fused["gpu_seconds"].value
    assert m1["padding_ratio"].value < fused["padding_ratio"].value
    assert seq["gpu_seconds"].value > 0
    gpus = 0
    for d in info["deployment"]:  # e.g. "2xTP2PP2(8192)"
        dp, rest = d.split("x", 1)
        tp = int(rest[2:].split("P")[0].split("(")[0])
        pp = int(rest.split("PP")[1].split("(")[0]) if "PP" in rest else 1
        gpus += int(dp) * tp * pp
    assert gpus == wl.num_gpus and info["planner_kept"] >= 1


def test_bad_inputs_one_line(job):
    wl, hw = job
    bad = dataclasses.replace(wl, tasks=[dataclasses.replace(wl.tasks[0], batch_seqs=0)])
    with pytest.raises(ConfigError, match=r"workload.tasks\[0\].batch_seqs: task 'dolly' has no data"):
        system().check("sim", bad, hw, _Fault())
    long = dataclasses.replace(wl.tasks[1], lengths=dataclasses.replace(wl.tasks[1].lengths, max_len=1 << 20))
    with pytest.raises(ConfigError, match="longest sequence 1048576 is beyond every replica's max_tokens"):
        system().check("sim", dataclasses.replace(wl, tasks=[long]), hw, _Fault())
    with pytest.raises(ConfigError, match="system.dispatch: unknown value 'x'"):
        system(dispatch="x")
    from impl.lobra.plan import plan
    from impl.lobra.sim import schemes_for

    even_gpu = [x for x in schemes_for(system(), wl, hw, 2) if x.gpus % 2 == 0]
    with pytest.raises(ConfigError, match="workload.num_gpus: 7 GPUs: no combination of schemes sums to it"):
        plan(even_gpu, 7, [256], [4], 256)
