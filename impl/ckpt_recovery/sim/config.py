"""Sim-only knobs of the checkpoint-recovery systems. [R] = a
reconstructed input, its choice argued in impl/ckpt_recovery/README.md, section "Sim"."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class CkptSimKnobs:
    storage: str = "nas5"  # headline profile (impl.common.storage.emulator.PAPER_PROFILES)
    # Profiles priced in the same job as <metric>@<profile> (storage changes no layout).
    storage_profiles: List[str] = field(default_factory=lambda: ["nas5", "nas20", "nvme", "network"])
    splits: int = 32  # S, as in the authors' code
    # The layout the job trains on before any failure: fastest = the faster of the workload's
    # nominal (dp, tp, pp) and the fastest homogeneous mesh on every GPU (the recovery planner's
    # own search), so no recovery on fewer GPUs can beat the healthy job (under the step model
    # the reconstructed nominal TP of S1-S3 is 13-30% slower than a TP1-2 mesh); nominal = the
    # workload's layout as given.
    base_layout: str = "fastest"
    d2h_bytes_per_s: float = 25.0e9  # [R] pinned device-to-host snapshot copy
    detect_s: float = 10.0  # heartbeat timeout (the authors' code: silent > 10 s = dead)
    restart_s: float = 60.0  # [R] stop survivors, relaunch processes, NCCL init, build the model
    plan_s: float = 10.0  # [R] ours: heterogeneous planner (ILPs) on the critical path
    mesh_plan_s: float = 1.0  # [R] rectangular baselines: pick a (dp, tp, pp)
    min_interval_s: float = 20.0  # async saves: at most one per min_interval (the authors' default)
    commit_calls: int = 4  # barrier-side requests of a commit: manifest, rename, pointer tmp, rename
    # An option of the authors' code (ours only): after each commit, every rank file is also copied to the local
    # NVMe of this many other nodes; a load reads a file from a surviving copy, else from storage.
    local_copies: int = 0
    # Peer memory (ours only, system ckpt_recovery_peer): after each snapshot, every rank file is
    # also copied into the host memory of this many other nodes (sim/peer.py).
    peer_copies: int = 0
    host_mem_bytes_per_node: float = 2.0e12  # [R] DGX H100: 2 TB of system memory
    train_host_bytes_per_gpu: float = 100.0e9  # [R] training's own host memory per GPU (loader, pinned buffers, CUDA/NCCL)
    # Share of node losses that also take every copy of each file with a copy on the dead node
    # (its failure domain held them all); their recovery reads storage. Only copies are lost,
    # no GPU (the failure trace stays the one every system sees).
    peer_correlated_frac: float = 0.0
    # fixed: the tiers above as set (copies that do not fit are refused). auto (peer memory, policy
    # ckpt_recovery): per storage profile, run the tier set with the highest ETTR *predicted*
    # over the failure model's mix (single_gpu_frac one-GPU losses, else a node), never the
    # scenario's own fault: peer copies (peer_copies, if they fit in host memory), local copies
    # (k = 1), or storage alone (impl/ckpt_recovery/README.md, "Peer memory").
    tier_choice: str = "fixed"
    # Failure model [R] from Llama 3 405B (arXiv 2407.21783: 419 unexpected interruptions / 54 days /
    # 16,384 GPUs; 58.7% GPU-side).
    failure_rate_per_gpu_h: float = 2.0e-5
    single_gpu_frac: float = 0.587
    repair_h: List[float] = field(default_factory=lambda: [2.0, 6.0])  # U(lo, hi); one-failure runs use the mean
    # "fault": the job's gpu_loss / node_loss, recurring at the failure model's rate (S1-S4);
    # "poisson": seeded Poisson failures over ``days`` in ``trials`` replicas (S5, S6).
    failures: str = "fault"
    days: float = 7.0
    trials: int = 64
