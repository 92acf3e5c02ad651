"""Closed-form transformer costs: FLOPs, bytes, parameters, per-stage op times.

Conventions, kept deliberately simple so a reader can audit every number:
- Forward FLOPs of one layer = 2·b·s·(weight-matrix parameters) + 4·b·s²·h; for a GPT
  shape that is (8 + 4·ffn_mult)·b·s·h² + 4·b·s²·h, Megatron-LM's 24·b·s·h² + 4·b·s²·h at
  ffn_mult = 4 (QKV+O projections 8bsh², MLP 16bsh², scores and weighted values 4bs²h).
- A shape is GPT (GELU MLP of ffn_mult·h, biases, LayerNorms) when ``ffn_hidden`` is 0 and
  LLaMA (SwiGLU MLP of ffn_hidden, no biases, RMSNorms, grouped-query K/V) otherwise; every
  count below follows that one switch.
- Backward is split as in ZeroBubble: B (input gradient) ≈ W (weight gradient) ≈ F FLOPs, so
  a full backward is 2F.
- Embedding and LM head are not counted (only layers are priced).
- Tensor parallelism divides layer FLOPs by tp and adds Megatron's two all-reduces of the
  activation (b·s·h elements) per layer to F and two to B; W needs no communication.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from impl.common.api import ConfigError
from impl.common.hardware import HardwareProfile
from impl.common.workloads.pipeline import ModelShape
from impl.common.megatron.derive import step_knobs
from impl.common.megatron.model import MegatronModel
from impl.common.megatron.step import F_ATTN, F_ELEM, F_GEMM, F_LAYERS, layer_terms, theta_of

from .comm import ring_allreduce_time_s

BYTES_PER_ELEM = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


def bytes_per_elem(dtype: str) -> int:
    if dtype not in BYTES_PER_ELEM:
        raise ConfigError(f"dtype {dtype!r} has no known element size (known: {', '.join(sorted(BYTES_PER_ELEM))})")
    return BYTES_PER_ELEM[dtype]


def forward_flops_per_layer(micro_batch_size: int, seq_len: int, hidden: int, ffn_mult: int = 4) -> float:
    b, s, h = micro_batch_size, seq_len, hidden
    return float((8 + 4 * ffn_mult) * b * s * h * h + 4 * b * s * s * h)


def is_swiglu(model) -> bool:
    return bool(getattr(model, "ffn_hidden", 0))


def ffn_size(model) -> int:
    """MLP width: the SwiGLU width when set, else ffn_mult * hidden (GPT)."""
    return int(model.ffn_hidden) if is_swiglu(model) else int(model.ffn_mult * model.hidden)


def kv_size(model) -> int:
    """Width of the K (and V) projection: hidden for multi-head attention, less with GQA."""
    return int(model.kv_hidden) if hasattr(model, "kv_hidden") else int(model.hidden)


def layer_matrix_params(model) -> int:
    """Weight-matrix parameters of one layer (no biases/norms): Q and O h² each, K and V
    h·kv each (4h² without GQA), plus the MLP's (3 or 2)·h·f."""
    h, f, kv = model.hidden, ffn_size(model), kv_size(model)
    return 2 * h * h + 2 * h * kv + (3 if is_swiglu(model) else 2) * h * f


def layer_params(model) -> int:
    """All parameters of one layer. GPT: the matrices, a bias on each projection
    (2h + 2kv + f + h) and two LayerNorms (4h), i.e. (4 + 2·ffn_mult)h² + (9 + ffn_mult)h;
    LLaMA: the matrices and two RMSNorm weights (2h), no biases."""
    h, f, kv = model.hidden, ffn_size(model), kv_size(model)
    if is_swiglu(model):
        return layer_matrix_params(model) + 2 * h
    return layer_matrix_params(model) + (2 * h + 2 * kv + f + h) + 4 * h


def model_params(model) -> int:
    """Layers, embeddings and the final norm. GPT (GPT-2's layout): token and position
    embeddings, LM head tied to the token embedding, final LayerNorm (2h). LLaMA (HF
    ``LlamaForCausalLM`` untied, as :func:`impl.common.llm.model.build_llama` builds it):
    token embedding, LM head, final RMSNorm (h); rotary positions have no table."""
    h, v = model.hidden, model.vocab
    edges = 2 * v * h + h if is_swiglu(model) else (v + model.seq_len) * h + 2 * h
    return model.num_layers * layer_params(model) + edges


def layer_fwd_flops(model, micro_batch_size: int) -> float:
    """Forward FLOPs of one layer of ``model``: 2·b·s·(matrix params) + 4·b·s²·h, i.e.
    b·s·(8h² + MLP) + 4·b·s²·h with MLP = 6hf for SwiGLU (3 matrices) or 4hf for GPT (2);
    equals :func:`forward_flops_per_layer` for GPT."""
    b, s, h = micro_batch_size, model.seq_len, model.hidden
    return float(2 * b * s * layer_matrix_params(model) + 4 * b * s * s * h)


def activation_msg_bytes(micro_batch_size: int, seq_len: int, hidden: int, dtype: str) -> float:
    """Bytes of one pipeline message (activation forward or its gradient backward)."""
    return float(micro_batch_size * seq_len * hidden * bytes_per_elem(dtype))


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
    """Time of one per-layer TP all-reduce at the step model's link efficiencies; TP groups fill
    a node before spanning the next."""
    if tp <= 1:
        return 0.0
    nbytes = tp_allreduce_bytes_per_layer(micro_batch_size, seq_len, hidden, dtype)
    return ring_allreduce_time_s(nbytes, tp, hw)


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
    if dtype in ("bf16", "fp16"):
        compute_s, ar_s = _step_layer_s(model, micro_batch_size, tp, hw)
    elif hw.measured:
        # A measured host (system=harness/calibrate, e.g. the CPU fidelity runs in fp32): its peak is the
        # matmul rate it achieved; the GPU step model's tables are bf16 kernels.
        if dtype not in hw.peak_flops:
            raise ConfigError(f"hardware {hw.name}: no measured {dtype} FLOP/s (has {', '.join(sorted(hw.peak_flops))})")
        compute_s = layer_fwd_flops(model, micro_batch_size) / (tp * hw.peak_flops[dtype])
        ar_s = tp_allreduce_time_s(micro_batch_size, model.seq_len, model.hidden, dtype, tp, hw)
    else:
        raise ConfigError(f"workload.dtype: {dtype} on datasheet profile {hw.name}: the Megatron step model prices "
                          f"bf16/fp16 steps (fp32 needs a measured profile, hardware=local from system=harness/calibrate)")
    tf = tuple(n * (compute_s + 2 * ar_s) for n in layers)
    tb = tf  # same FLOPs and the same two all-reduces
    tw = tuple(n * compute_s for n in layers)
    return StageCosts(tf, tb, tw, layers)


def _step_layer_s(model, micro_batch_size: int, tp: int, hw: HardwareProfile) -> tuple[float, float]:
    """One layer's forward compute from the Megatron step model (a third of its forward + backward
    GEMM, attention, memory-bound and overhead terms: B ≈ W ≈ F as above) and one TP all-reduce
    at the step model's bus bandwidth."""
    rows = float(micro_batch_size * model.seq_len)
    f = layer_terms(MegatronModel.from_shape(model), tp, rows, rows * model.seq_len, hw, hw.gpus_per_node)
    th = theta_of(hw, step_knobs(hw))
    keep = np.zeros_like(th)
    keep[[F_GEMM, F_ELEM, F_ATTN, F_LAYERS]] = 1.0
    compute_fwd = float(f @ (th * keep)) / 3.0
    if tp <= 1:
        return compute_fwd, 0.0
    nbytes = tp_allreduce_bytes_per_layer(micro_batch_size, model.seq_len, model.hidden, "bf16")
    return compute_fwd, ring_allreduce_time_s(nbytes, tp, hw)


def stage_grad_bytes(model: ModelShape, stages: int, dtype: str, tp: int = 1) -> tuple[float, ...]:
    """Gradient bytes per stage and TP rank (what a DP all-reduce moves); embeddings ignored."""
    per_layer = layer_params(model) * bytes_per_elem(dtype) / tp
    return tuple(n * per_layer for n in layer_split(model.num_layers, stages))
