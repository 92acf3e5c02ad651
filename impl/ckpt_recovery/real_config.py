"""Real-mode knobs of the checkpoint-recovery system (the nested ``real:`` node of its config)."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class CkptStorage(enum.StrEnum):
    """Where real-mode checkpoints go: an emulated NAS (5 ms per call, 200 MB/s per rank) or local disk."""

    nas = "nas"
    local = "local"


class RelayoutChoice(enum.StrEnum):
    """The layout after a loss: auto (this system re-plans on the survivors, the baselines take the
    best homogeneous fit), or forced: replan, homogeneous, same (a replacement rank is there)."""

    auto = "auto"
    replan = "replan"
    homogeneous = "homogeneous"
    same = "same"


class CkptScenario(enum.StrEnum):
    """recovery: the multi-rank kill-and-recover loop (scenario A); one_gpu: one process (world 1)
    saving and reloading its training state where the job runs (the GPU under execution=cuda)."""

    recovery = "recovery"
    one_gpu = "one_gpu"


STORAGES, RELAYOUTS, SCENARIOS = tuple(CkptStorage), tuple(RelayoutChoice), tuple(CkptScenario)
@dataclass
class CkptRealKnobs:
    scenario: CkptScenario = CkptScenario.recovery
    storage: CkptStorage = CkptStorage.nas
    splits: int = 32  # S: splits per sharded tensor (divisible by every TP degree used)
    ckpt_every: int = 3  # steps between save attempts (a save in flight makes one skip)
    keep: int = 2  # committed copies kept
    dropout: float = 0.1  # on the embedding output, counter-based RNG (seed, step, sample)
    hb_timeout_s: float = 10.0  # a rank silent this long is dead (its process exiting is seen at once)
    mem_budget: float = 0.6  # per-rank state / whole state: forbids unsharded layouts ([R]: README, scenario A)
    relayout: RelayoutChoice = RelayoutChoice.auto
    timeout_s: float = 600.0  # per launch
    threads: int = 1  # torch threads per rank
    # Peer-memory tier (ckpt_recovery_peer): each rank file also held in its node's
    # holder and in ``peer_copies`` other nodes' holders (0: storage only).
    peer_copies: int = 0
    peer_net: str = "net"  # profile of a read from another node's memory (emulated)
    # shared memory the peer tier may use on the host (0: what /dev/shm has free); emulated
    # nodes share one host, so their copies are summed
    host_mem_bytes: float = 0.0
    # one_gpu: the synthetic training step between save attempts (matmuls on the job's device)
    step_s: float = 1.0
    # one_gpu: directory the checkpoints go under ("": the system's temp dir); removed after
    root: str = ""
