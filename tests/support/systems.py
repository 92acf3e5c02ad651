"""Systems used only by the harness tests (found through hydra.searchpath=[file://tests/conf])."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from impl.common.api import JobContext, Metric, RunResult, System


class Echo(System):
    """Deterministic: metrics are a pure function of seed and knobs."""

    @dataclass
    class Config:
        base_s: float = 1.0
        factor: float = 1.0
        sleep_s: float = 0.0
        burn_s: float = 0.0  # CPU seconds of busy loop, for host-load tests
        ranks: int = 0  # > 0: the burn runs on that many local ranks (launch()), not in the job

    def run(self, job: JobContext) -> RunResult:
        if self.cfg.sleep_s:
            time.sleep(self.cfg.sleep_s)
        rank_pids: list = []
        if self.cfg.ranks:
            from impl.common.runtime.launch import launch

            rank_pids = launch(_burn_rank, self.cfg.ranks, (self.cfg.burn_s,), label="echo", timeout_s=120).results
        else:
            _burn(self.cfg.burn_s)
        t = self.cfg.base_s * self.cfg.factor * (1.0 + job.seed / 1000.0)
        if job.fault.kind == "rank_kill":
            raise RuntimeError(f"worker rank {job.fault.rank} killed at iteration {job.fault.at_iter}\nsecond line")
        samples = [t, t * 1.01, t * 0.99] if job.mode == "real" else [t]
        return RunResult(metrics={"iteration_time_s": Metric.from_samples(samples, "s", "lower"),
                                  "throughput": Metric.scalar(1.0 / t, "samples/s", "higher")},
                         info={"pid": os.getpid(), "rank_pids": rank_pids})


def _burn(cpu_s: float) -> None:
    t0 = time.process_time()
    while time.process_time() - t0 < cpu_s:
        pass


def _burn_rank(ctx, cpu_s: float) -> int:
    _burn(cpu_s)
    return os.getpid()
