"""Real-mode knobs of the checkpoint-recovery system (the nested ``real:`` node of its config)."""
from __future__ import annotations

from dataclasses import dataclass

STORAGES = ("nas", "local")
RELAYOUTS = ("auto", "replan", "homogeneous", "same")
# The policies real mode runs: policy -> (checkpoint backend, layout after a loss).
REAL_POLICIES = {"ckpt_recovery": ("elastor", "replan"), "dcp_sync": ("dcp_sync", "homogeneous"),
                 "dcp_async": ("dcp_async", "homogeneous"),
                 "dcp_async_process": ("dcp_async_process", "homogeneous"), "restart_all": ("elastor", "homogeneous")}


@dataclass
class RealKnobs:
    storage: str = "nas"  # emulated NAS (5 ms per call, 200 MB/s per rank) or local disk
    splits: int = 32  # S: splits per sharded tensor (divisible by every TP degree used)
    ckpt_every: int = 3  # steps between save attempts (a save in flight makes one skip)
    keep: int = 2  # committed copies kept
    dropout: float = 0.1  # on the embedding output, counter-based RNG (seed, step, sample)
    hb_timeout_s: float = 10.0  # a rank silent this long is dead (its process exiting is seen at once)
    mem_budget: float = 0.6  # per-rank state / whole state: forbids unsharded layouts (spec 5)
    # auto: this system re-plans on the survivors, the baselines take the best homogeneous fit;
    # same: a replacement rank is there (repair done), the nominal layout again
    relayout: str = "auto"
    timeout_s: float = 600.0  # per launch
    threads: int = 1  # torch threads per rank
