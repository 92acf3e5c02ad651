"""Real multi-process pipeline runtime (gloo on CPU): equality with the single-process model.

Every run trains the tiny GPT (d=32, 2 blocks per stage, seq 16, micro-batch 2) for two
iterations with SGD. Equality is **bitwise** (``==`` on losses, ``torch.equal`` on grads and
parameters, identical sha256 digests): gradients are accumulated in micro-batch order on every
path, and the reference runs with the workers' thread count (1).
"""
from __future__ import annotations

import functools

import psutil
import pytest
import torch

from impl.common.fault_model.spec import LinkDelay
from impl.common.api import ConfigError
from impl.common.models.tiny_gpt import params_digest, reference_train
from impl.common.runtime.executor import LaunchOptions, NamedSchedule, PerIterationSchedule, PipelineJob, run_pipeline
from impl.common.schedule.generators import generate
from impl.common.schedule.ir import parse_schedule
from impl.common.workloads.pipeline import ModelShape, PipelineWorkload

pytestmark = [pytest.mark.real, pytest.mark.timeout(180)]
torch.set_num_threads(1)  # the workers' thread count: same kernels, same bits
ITERS = 2


def _workload(S: int, N: int) -> PipelineWorkload:
    shape = ModelShape(num_layers=2 * S, hidden=32, heads=4, ffn_mult=2, vocab=64, seq_len=16)
    return PipelineWorkload(model=shape, stages=S, micro_batch_size=2, num_microbatches=N, torch_threads=1)


@functools.lru_cache(maxsize=None)
def _reference(S: int, N: int):
    wl = _workload(S, N)
    return reference_train(wl.model, wl.micro_batch_size, N, ITERS, seed=0, optimizer="sgd", lr=0.1)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _stray_workers() -> list:
    """Live processes under this test's fork server (where every worker is forked)."""
    stray = []
    for child in psutil.Process().children():
        try:
            if any("forkserver" in part for part in child.cmdline()):
                stray += [p for p in child.children(recursive=True) if _alive(p.pid)]
        except psutil.NoSuchProcess:
            pass
    return stray


def _run(S, N, schedule_fn, comm, optimizer_name="sgd", pg_timeout_s=60, validate=True, **kw):
    wl = _workload(S, N)
    job = PipelineJob(schedule_fn, wl, comm=comm, iterations=ITERS, warmup=0, seed=0, optimizer=optimizer_name,
                      lr=0.1, **kw)
    return run_pipeline(job, LaunchOptions(pg_timeout_s=pg_timeout_s, timeout_s=150, validate=validate))


def _assert_equal_to_reference(stats, S, N):
    ref = _reference(S, N)
    assert stats.losses == ref.losses
    assert sorted(stats.params) == sorted(ref.params)
    for name, p in ref.params.items():
        assert torch.equal(stats.params[name], p), name
        assert torch.equal(stats.last_grads[name], ref.last_grads[name]), name
    assert stats.params_digest == params_digest(ref.params)


def _assert_messages(stats, S, N):
    expected = {f"{i}->{i + 1} fwd": N for i in range(S - 1)} | {f"{i + 1}->{i} bwd": N for i in range(S - 1)}
    assert stats.messages == [expected] * ITERS


CASES = [
    # (S, N, schedule, comm, K, delay on (0, 1) in seconds)
    (4, 8, "1f1b", "inline", None, 0.0),
    (4, 8, "zb", "fifo", None, 0.0),
    (4, 8, "gpipe", "delegated", 4, 0.0),
    (4, 8, "zb", "delegated", 2, 0.005),
    (3, 6, "1f1b", "fifo", None, 0.005),
    (3, 6, "zb", "delegated", 3, 0.0),
    (2, 4, "gpipe", "inline", None, 0.005),
]


@pytest.mark.parametrize("S,N,schedule,comm,K,delay", CASES, ids=[f"S{c[0]}-{c[2]}-{c[3]}" + ("-delay" if c[5] else "")
                                                                  for c in CASES])
def test_pipeline_equals_single_process(S, N, schedule, comm, K, delay):
    stats = _run(S, N, NamedSchedule(schedule, S, N), comm, num_delegates=K,
                 delays={(0, 1): delay} if delay else None)
    _assert_equal_to_reference(stats, S, N)
    _assert_messages(stats, S, N)
    assert stats.comm_paths == [comm] * ITERS
    assert stats.injected_delays_s[0]["0-1"] == delay
    assert not any(_alive(pid) for pid in stats.child_pids), "leftover child processes"
    assert _stray_workers() == []
    assert stats.summary()["messages"] == stats.messages
    if comm == "delegated":
        # 2 roles x 2 directions x (S-1) links x K delegates, each handled N/K messages per iteration
        assert len(stats.delegate_messages) == 4 * (S - 1) * K
        assert set(stats.delegate_messages.values()) == {N // K * ITERS}
    if schedule == "1f1b":  # stage i holds at most its warm-up + 1 activations
        assert stats.peak_in_flight == {i: min(S - i, N) for i in range(S)}
    if schedule == "zb":  # B and W ran split: every stage did N of each per iteration
        assert all(c["B"] == N * ITERS and c["W"] == N * ITERS for c in stats.op_counts.values())


def test_schedule_switches_at_iteration_boundary():
    S, N = 2, 4
    fn = PerIterationSchedule([generate("1f1b", S, N), generate("zb", S, N)])
    stats = _run(S, N, fn, "fifo")
    assert stats.schedule_index == [0, 1] and len(stats.schedules) == 2
    _assert_equal_to_reference(stats, S, N)


def test_measured_detection_sees_the_injected_delay():
    S, N = 2, 4
    fault = LinkDelay(links=[[0, 1]], delay_s=0.03, detection="measured")
    stats = _run(S, N, NamedSchedule("1f1b", S, N), "fifo", delays=fault)
    assert stats.detection == "measured"
    # The scheduler never sees the injected table in measured mode: it starts blind...
    assert stats.scheduler_delays_s[0] == {"0-1": 0.0}
    # ...and every delayed message's transit includes the 30 ms sleep, so the estimate after
    # two iterations (patience 2) is at least that minus the floor and rounding.
    assert min(t["0-1"] for t in stats.min_transit_s) >= 0.03
    assert stats.estimated_delays_s[-1]["0-1"] >= 0.028
    _assert_equal_to_reference(stats, S, N)


def test_delegate_count_must_divide_microbatches():
    wl = _workload(2, 24)
    with pytest.raises(ConfigError, match="num_microbatches 24 is not divisible by delegate count 5"):
        run_pipeline(PipelineJob(NamedSchedule("zb", 2, 24), wl, comm="delegated", num_delegates=5,
                                 iterations=1, warmup=0))


def test_nonexistent_link_is_rejected():
    wl = _workload(4, 8)
    with pytest.raises(ConfigError, match=r"fault.links: link \(3, 4\) does not exist in a 4-stage pipeline"):
        run_pipeline(PipelineJob(NamedSchedule("1f1b", 4, 8), wl, comm="inline",
                                 delays=LinkDelay(links=[[3, 4]], delay_s=0.01), iterations=1, warmup=0))


def test_blocking_sends_deadlock_is_rejected_before_launch():
    wl = _workload(2, 4)
    with pytest.raises(ConfigError, match="deadlock"):  # ZB needs buffered sends
        run_pipeline(PipelineJob(NamedSchedule("zb", 2, 4), wl, comm="inline", iterations=1, warmup=0))


def test_worker_failure_raises_one_line_naming_the_rank():
    S, N = 2, 2
    # Iteration 0 is fine; iteration 1's schedule makes rank 1 run F0 without receiving it.
    good = parse_schedule("0: F0 SF0>1 F1 SF1>1 RB0<1 BW0 RB1<1 BW1\n"
                          "1: RF0<0 F0 BW0 SB0>0 RF1<0 F1 BW1 SB1>0")
    bad = parse_schedule("0: F0 SF0>1 F1 SF1>1 RB0<1 BW0 RB1<1 BW1\n"
                         "1: F0 RF0<0 BW0 SB0>0 RF1<0 F1 BW1 SB1>0")
    with pytest.raises(RuntimeError, match=r"^pipeline rank 1 failed: .*F0") as info:
        _run(S, N, PerIterationSchedule([good, bad]), "delegated", num_delegates=2, validate=False, pg_timeout_s=20)
    assert "\n" not in str(info.value)
    assert _stray_workers() == []  # trainers and delegates were all stopped


def test_delegates_switch_on_when_a_delay_appears_adam():
    S, N = 2, 4
    fault = LinkDelay(links=[[0, 1]], delay_s=0.005, start_iter=1)
    stats = _run(S, N, NamedSchedule("zb", S, N), "delegated", num_delegates=2, delays=fault,
                 delegate_when="on_delay", optimizer_name="adam")
    assert stats.comm_paths == ["fifo", "delegated"]  # GPU-path until the delay is seen
    assert set(stats.delegate_messages.values()) == {N // 2}  # one delegated iteration
    ref = reference_train(_workload(S, N).model, 2, N, ITERS, seed=0, optimizer="adam", lr=0.1)
    assert stats.losses == ref.losses
    assert stats.params_digest == params_digest(ref.params)
