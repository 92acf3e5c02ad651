"""IPC benchmark transports (impl/caraserve/README.md): the shared-memory ring and the ``multiprocessing.Queue`` baseline both
return exactly the worker's ``-x``, byte for byte (timings: tests/speed/test_ipc_speed.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from impl.caraserve.cpu_prefill import QueueWorker, ShmWorker, negate_job

ROWS, D = 8192, 256  # 8 MiB of fp32 activations per job


@pytest.mark.real
def test_shm_ring_and_queue_return_the_workers_bytes():
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((ROWS, D), dtype=np.float32) for _ in range(3)]
    xs.append(rng.standard_normal((7, D), dtype=np.float32))  # a short job reads only its rows
    with ShmWorker(negate_job, (), max_rows=ROWS, d_in=D, d_out=D, slots=2) as shm, QueueWorker() as q:
        # Posted before any wait, 4 jobs on 2 slots: a slot reused before its result was read
        # would hand back another job's bytes.
        handles = [shm.post(torch.from_numpy(x)) for x in xs]
        for x, h in zip(xs, handles):
            want = np.negative(x).tobytes()
            (y,) = h.wait()
            assert y.shape == x.shape and y.numpy().tobytes() == want
            assert q.roundtrip(x).tobytes() == want
        assert shm.jobs == len(xs)
