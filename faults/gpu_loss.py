"""GPU and node loss (checkpoint recovery's scenario A and sim S1-S6, `impl/ckpt_recovery/README.md`,
"Reconstructed choices"): validation and the lost GPU ids, one definition for the sim and the
real recovery loop."""
from __future__ import annotations

from impl.common.api import ConfigError

LOSS_KINDS = ("gpu_loss", "node_loss")


def validate_loss(fault, num_gpus: int, gpus_per_node: int) -> None:
    """One-line ConfigError for a loss the cluster cannot have."""
    if fault.kind not in LOSS_KINDS:
        raise ConfigError(f"fault.kind: {fault.kind!r} is not a GPU loss (one of: {', '.join(LOSS_KINDS)})")
    if fault.at_step < 0:
        raise ConfigError(f"fault.at_step must be >= 0, got {fault.at_step}")
    if fault.kind == "node_loss":
        nodes = num_gpus // gpus_per_node
        if not 0 <= fault.node < nodes:
            raise ConfigError(f"fault.node: node {fault.node} does not exist (the workload has {nodes} nodes: 0..{nodes - 1})")
        return
    ranks = list(fault.ranks)
    if not ranks:
        raise ConfigError("fault.ranks: a gpu_loss needs at least one rank")
    for r in ranks:
        if not 0 <= r < num_gpus:
            raise ConfigError(f"fault.ranks: rank {r} does not exist (the workload has {num_gpus} GPUs: 0..{num_gpus - 1})")
    if len(set(ranks)) != len(ranks):
        raise ConfigError(f"fault.ranks: {ranks} lists a rank twice")
    if len(ranks) >= num_gpus:
        raise ConfigError(f"fault.ranks: {len(ranks)} lost GPUs leave no survivor of {num_gpus}")


def lost_gpus(fault, gpus_per_node: int) -> tuple[int, ...]:
    """The GPU ids the fault takes out, ascending."""
    if fault.kind == "node_loss":
        return tuple(range(fault.node * gpus_per_node, (fault.node + 1) * gpus_per_node))
    return tuple(sorted(fault.ranks))
