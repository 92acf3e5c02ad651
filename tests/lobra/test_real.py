"""LobRA real mode (the first real experiment, impl/lobra/README.md): 2 gloo replicas (R_L + R_S) through the launcher; the all-reduced
adapter gradients equal a single-process step over the same global batch, the base stays
frozen; preflight rejects a sequence beyond every replica's max_tokens in one line."""
import dataclasses

import pytest
import torch

from impl.common.api import ConfigError
from impl.common.varlen.lengths import LengthDist
from impl.common.workloads.multitask_lora import MultitaskLoraWorkload, TaskSpec
from impl.common.workloads.varlen import VarlenModelShape
from impl.lobra.real import make_job, run_job, summarise
from impl.lobra.system import LobRA


class _Fault:
    kind = "none"


def _wl(cap_long=256, steps=1):
    tasks = [TaskSpec("short", LengthDist(kind="lognormal", median=24, sigma=0.5, min_len=4, max_len=64), 4),
             TaskSpec("long", LengthDist(kind="lognormal", median=90, sigma=0.6, min_len=4, max_len=cap_long), 3)]
    model = VarlenModelShape(name="tiny", num_layers=2, hidden=64, heads=4, ffn_hidden=128, vocab=512, seq_len=256)
    return MultitaskLoraWorkload(model=model, num_gpus=2, tasks=tasks, steps=steps, warmup_steps=0, lora_rank=4,
                                 lora_alpha=8.0)


def _system(**real):
    cfg = LobRA.Config(num_buckets=4, fixed_buckets=[32, 64, 128, 256], ilp_time_limit_s=2.0)
    cfg.real.large_max_tokens, cfg.real.small_max_tokens = 256, 64
    cfg.real.profile_mbs, cfg.real.profile_lengths = [1, 2], [16, 32, 64, 128]
    cfg.real.init_b_zero = False
    for k, v in real.items():
        setattr(cfg.real, k, v)
    return LobRA(cfg, "lobra")


@pytest.mark.real
def test_two_replica_grads_equal_single_process_and_base_frozen():
    wl = _wl()
    s = _system(interleave=["lobra", "task_sequential"], check_steps=1)
    s.check("real", wl, None, _Fault())
    job = make_job(s, wl, seed=3)
    results = run_job(job, timeout_s=300)
    checks = results[0]["checks"]
    # lobra: one phase over every task; task_sequential: one phase per task
    assert {c["policy"] for c in checks} == {"lobra", "task_sequential"}
    assert len([c for c in checks if c["policy"] == "task_sequential"]) == 2
    for c in checks:
        assert c["grad_rel_err"] < 1e-5, c
    assert all(r["base_bit_identical"] for r in results)
    # lobra split the step over both replicas, and each rank ran its own kind
    ph0, ph1 = results[0]["logs"]["lobra"][0]["phases"][0], results[1]["logs"]["lobra"][0]["phases"][0]
    assert (ph0["kind"], ph1["kind"]) == ("R_L", "R_S")
    assert ph0["micro_batches"] and ph1["micro_batches"]
    assert all(s <= 64 for _, s, _, _ in ph1["micro_batches"])  # R_S holds only what fits it
    res = summarise(results, job, 0, "lobra", 1e-5)
    assert res.metrics["grad_max_rel_err"].value < 1e-5
    assert "cpu_seconds" in res.metrics and "reduction_vs_task_sequential" in res.metrics
    assert set(res.info["cost_fit"]) == {"R_L", "R_S"}


def test_preflight_length_beyond_every_replica():
    wl = _wl(cap_long=300)
    with pytest.raises(ConfigError, match=r"^workload.tasks: the longest sequence 300 \(task 'long'\) is beyond every "
                                          r"replica's max_tokens \(R_L 256, R_S 64\)$"):
        _system().check("real", wl, None, _Fault())


def test_preflight_needs_two_replicas():
    wl = dataclasses.replace(_wl(), num_gpus=4)
    with pytest.raises(ConfigError, match=r"^workload.num_gpus: real mode runs 2 replicas"):
        _system().check("real", wl, None, _Fault())


@pytest.mark.real
def test_a_bf16_base_runs_through_the_same_functions_on_the_launchers_device():
    import dataclasses

    wl = _wl()
    s = _system(interleave=["lobra"], check_steps=1)
    job = dataclasses.replace(make_job(s, wl, seed=3), dtype="bf16")
    results = run_job(job, timeout_s=300)
    want = "cuda:0" if torch.cuda.device_count() >= 2 else "cpu"
    assert results[0]["device"] == want and results[0]["backend"] == ("nccl" if want != "cpu" else "gloo")
    # a bf16 base against a bf16 single-process reference on the same device: the same step
    assert all(c["grad_rel_err"] < 5e-2 for c in results[0]["checks"]), results[0]["checks"]
    assert all(r["base_bit_identical"] for r in results)
    res = summarise(results, job, 0, "lobra", 5e-2)
    assert res.metrics["gpu_seconds"].unit == ("GPU-s" if want != "cpu" else "CPU-s")
