"""Closed-form cost models: transformer op times, communication, per-link costs."""
from .comm import LinkCosts, dp_allreduce_time_s, p2p_time_s, ring_allreduce_time_s, same_node
from .transformer import (
    BYTES_PER_ELEM,
    StageCosts,
    activation_msg_bytes,
    bytes_per_elem,
    forward_flops_per_layer,
    layer_params,
    layer_split,
    model_params,
    stage_costs,
    stage_grad_bytes,
    tp_allreduce_bytes_per_layer,
    tp_allreduce_time_s,
)

__all__ = [
    "BYTES_PER_ELEM", "LinkCosts", "StageCosts", "activation_msg_bytes", "bytes_per_elem",
    "dp_allreduce_time_s", "forward_flops_per_layer", "layer_params", "layer_split", "model_params",
    "p2p_time_s", "ring_allreduce_time_s", "same_node", "stage_costs", "stage_grad_bytes",
    "tp_allreduce_bytes_per_layer", "tp_allreduce_time_s",
]
