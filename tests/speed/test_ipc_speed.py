"""CaraServe's IPC check (our reconstruction; `impl/caraserve/README.md`, "IPC and cost-law
measurements"): 8 MiB of activations to a spawned worker (1 thread) and back, through the CPU LoRA
worker's shared-memory ring + sequence flag vs ``multiprocessing.Queue`` (pickling both ways).
The worker negates (``negate_job``), so each path moves 8 MiB in and 8 MiB out. Expect shm
several times faster. Time with ``pytest tests/speed/test_ipc_speed.py --benchmark-enable``;
without it each runs once, as a correctness check (see also tests/caraserve/test_ipc.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from impl.caraserve.cpu_prefill import QueueWorker, ShmWorker, negate_job

ROWS, D = 8192, 256  # 8192 x 256 fp32 = 8 MiB
# 1 thread here too (measured: 16 ms instead of 3.5 ms per round trip with 2); the Queue path
# would otherwise get ~5 rounds.
pytestmark = [pytest.mark.benchmark(min_rounds=15), pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(0).standard_normal((ROWS, D), dtype=np.float32)


def test_ipc_shm_ring_8mib(benchmark, x):
    t = torch.from_numpy(x)
    with ShmWorker(negate_job, (), max_rows=ROWS, d_in=D, d_out=D, threads=1, slots=2) as w:
        (y,) = benchmark(lambda: w.post(t).wait())
    assert y.numpy().tobytes() == np.negative(x).tobytes()


def test_ipc_mp_queue_8mib(benchmark, x):
    with QueueWorker() as q:
        y = benchmark(q.roundtrip, x)
    assert y.tobytes() == np.negative(x).tobytes()
