"""Closed-form transformer costs (spec adaptra §6): FLOPs, bytes, parameters, per-stage op times.

Conventions, kept deliberately simple so a reader can audit every number:
- Forward FLOPs of one layer = (8 + 4·ffn_mult)·b·s·h² + 4·b·s²·h, which is the spec's
  24·b·s·h² + 4·b·s²·h at ffn_mult = 4 (QKV+O projections 8bsh², MLP 16bsh², scores and
  weighted values 4bs²h).
- Backward is split as in ZeroBubble: B (input gradient) ≈ W (weight gradient) ≈ F FLOPs, so
  a full backward is 2F.
- Embedding and LM head are not counted (spec §6 costs layers only).
- Tensor parallelism divides layer FLOPs by tp and adds Megatron's two all-reduces of the
  activation (b·s·h elements) per layer to F and two to B; W needs no communication.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from impl.common.api import ConfigError
from impl.common.hardware import HardwareProfile
from impl.common.workloads.pipeline import ModelShape

from .comm import ring_allreduce_time_s

BYTES_PER_ELEM = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


def bytes_per_elem(dtype: str) -> int:
    if dtype not in BYTES_PER_ELEM:
        raise ConfigError(f"dtype {dtype!r} has no known element size (known: {', '.join(sorted(BYTES_PER_ELEM))})")
    return BYTES_PER_ELEM[dtype]


def forward_flops_per_layer(micro_batch_size: int, seq_len: int, hidden: int, ffn_mult: int = 4) -> float:
    b, s, h = micro_batch_size, seq_len, hidden
    return float((8 + 4 * ffn_mult) * b * s * h * h + 4 * b * s * s * h)


def ffn_size(model) -> int:
    """MLP width: the SwiGLU width when set, else ffn_mult * hidden (GPT)."""
    return int(model.ffn_hidden) if getattr(model, "ffn_hidden", 0) else int(model.ffn_mult * model.hidden)


def layer_fwd_flops(model, micro_batch_size: int) -> float:
    """Forward FLOPs of one layer of ``model``: b·s·(8h² + MLP) + 4·b·s²·h, MLP = 6hf for
    SwiGLU (3 matrices) or 4hf for GPT (2); equals :func:`forward_flops_per_layer` for GPT."""
    b, s, h, f = micro_batch_size, model.seq_len, model.hidden, ffn_size(model)
    mlp = 6 * h * f if getattr(model, "ffn_hidden", 0) else 4 * h * f
    return float(b * s * (8 * h * h + mlp) + 4 * b * s * s * h)


def layer_matrix_params(model) -> int:
    """Weight-matrix parameters of one layer (no biases/norms): 4h² + (3 or 2)·h·f."""
    h, f = model.hidden, ffn_size(model)
    return 4 * h * h + (3 if getattr(model, "ffn_hidden", 0) else 2) * h * f


def activation_msg_bytes(micro_batch_size: int, seq_len: int, hidden: int, dtype: str) -> float:
    """Bytes of one pipeline message (activation forward or its gradient backward)."""
    return float(micro_batch_size * seq_len * hidden * bytes_per_elem(dtype))


def layer_params(hidden: int, ffn_mult: int = 4) -> int:
    """Parameters of one layer: attention 4h²+4h, MLP 2·f·h²+(f+1)h, two layernorms 4h."""
    h, f = hidden, ffn_mult
    return (4 + 2 * f) * h * h + (9 + f) * h


def model_params(model: ModelShape) -> int:
    """Layers plus token and position embeddings (the LM head is tied to the embedding)."""
    return model.num_layers * layer_params(model.hidden, model.ffn_mult) + (model.vocab + model.seq_len) * model.hidden


def layer_split(num_layers: int, stages: int) -> tuple[int, ...]:
    """Layers per stage, as even as possible; the first ``num_layers % stages`` stages get one
    extra layer (so the slowest stages are the earliest, whose warm-up is longest anyway)."""
    if stages < 1:
        raise ConfigError(f"stages must be >= 1, got {stages}")
    if num_layers < stages:
        raise ConfigError(f"pipeline of {stages} stages cannot split {num_layers} layers (need >= 1 per stage)")
    q, r = divmod(num_layers, stages)
    return tuple(q + 1 if i < r else q for i in range(stages))


def tp_allreduce_bytes_per_layer(micro_batch_size: int, seq_len: int, hidden: int, dtype: str) -> float:
    """Bytes of ONE tensor-parallel all-reduce (Megatron does two per layer in F and two in B)."""
    return activation_msg_bytes(micro_batch_size, seq_len, hidden, dtype)


def tp_allreduce_time_s(micro_batch_size: int, seq_len: int, hidden: int, dtype: str, tp: int,
                        hw: HardwareProfile) -> float:
    """Time of one per-layer TP all-reduce; TP groups sit inside a node when tp <= gpus_per_node."""
    if tp <= 1:
        return 0.0
    intra = tp <= hw.gpus_per_node
    bw = hw.intra_node_bw_bytes_per_s if intra else hw.inter_node_bw_bytes_per_s
    lat = hw.intra_node_latency_s if intra else hw.inter_node_latency_s
    nbytes = tp_allreduce_bytes_per_layer(micro_batch_size, seq_len, hidden, dtype)
    return ring_allreduce_time_s(nbytes, tp, bw * hw.comm_efficiency, lat)


@dataclass(frozen=True)
class StageCosts:
    """Per-stage op times of one micro-batch: tF, tB (input grad), tW (weight grad)."""

    tf_s: tuple[float, ...]
    tb_s: tuple[float, ...]
    tw_s: tuple[float, ...]
    # Layers per stage when built from a model (empty for hand-set uniform costs).
    layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.tf_s)
        if n < 1 or len(self.tb_s) != n or len(self.tw_s) != n:
            raise ConfigError(f"StageCosts needs equal non-empty tf_s/tb_s/tw_s, got lengths "
                              f"{len(self.tf_s)}/{len(self.tb_s)}/{len(self.tw_s)}")
        for name in ("tf_s", "tb_s", "tw_s"):
            bad = [t for t in getattr(self, name) if not t >= 0.0]
            if bad:
                raise ConfigError(f"StageCosts.{name} must be >= 0 seconds, got {bad[0]}")

    @property
    def num_stages(self) -> int:
        return len(self.tf_s)

    @classmethod
    def uniform(cls, stages: int, tf_s: float, tb_s: Optional[float] = None,
                tw_s: Optional[float] = None) -> "StageCosts":
        """Every stage has the same op times; tB and tW default to tF (spec: B ≈ W ≈ F)."""
        tb = tf_s if tb_s is None else tb_s
        tw = tf_s if tw_s is None else tw_s
        return cls((tf_s,) * stages, (tb,) * stages, (tw,) * stages)

    @classmethod
    def from_lists(cls, tf_s: Sequence[float], tb_s: Sequence[float], tw_s: Sequence[float]) -> "StageCosts":
        return cls(tuple(map(float, tf_s)), tuple(map(float, tb_s)), tuple(map(float, tw_s)))


def stage_costs(model: ModelShape, stages: int, micro_batch_size: int, dtype: str, tp: int,
                hw: HardwareProfile) -> StageCosts:
    """Op times of each stage for ``model`` split over ``stages`` (see :func:`layer_split`)."""
    if tp < 1:
        raise ConfigError(f"tp must be >= 1, got {tp}")
    layers = layer_split(model.num_layers, stages)
    flops_per_s = hw.flops(dtype)
    compute_s = forward_flops_per_layer(micro_batch_size, model.seq_len, model.hidden, model.ffn_mult) / (tp * flops_per_s)
    ar_s = tp_allreduce_time_s(micro_batch_size, model.seq_len, model.hidden, dtype, tp, hw)
    tf = tuple(n * (compute_s + 2 * ar_s) for n in layers)
    tb = tf  # same FLOPs and the same two all-reduces
    tw = tuple(n * compute_s for n in layers)
    return StageCosts(tf, tb, tw, layers)


def stage_grad_bytes(model: ModelShape, stages: int, dtype: str, tp: int = 1) -> tuple[float, ...]:
    """Gradient bytes per stage and TP rank (what a DP all-reduce moves); embeddings ignored."""
    per_layer = layer_params(model.hidden, model.ffn_mult) * bytes_per_elem(dtype) / tp
    return tuple(n * per_layer for n in layer_split(model.num_layers, stages))
