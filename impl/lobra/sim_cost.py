"""Paper-scale schemes for sim mode (spec 2.1, 6): f_tp(mbs, s) and max_tokens per (tp, pp).

Derived, not profiled (only 7B profiles ship with the authors' code; spec 9):
- time: :func:`impl.common.cost.varlen_model.analytic_seq_cost` for one stage of
  ``Layout(1, tp, pp)`` (forward + backward FLOPs / (peak·mfu), 8 TP collectives of s·h·2 B per
  layer, pipeline p2p), split into its compute and communication parts. LoRA: the frozen
  weights need no weight-gradient GEMMs, so the matrix FLOPs are ⅔ of full fine-tuning
  (forward + input gradient); attention has no weights and keeps its 3x (spec 6).
- TP efficiency: the communication part is multiplied by one factor ``comm_scale`` chosen so
  that the per-GPU throughput of TP8 at 2K tokens is ``tp8_ratio`` (0.546 = 2.79 / 5.11, spec 4
  Table 3 [S2]) of TP1's. Every other Table-3 entry is then a prediction, reported next to the
  source in :func:`table3_check`.
- f is per layer with a fixed micro-batch overhead c6 (the collectives' latencies), linear in
  mbs otherwise: c1 = attention, c3 = matrices + collectives bandwidth, c2 = c4 = c5 = 0.
- memory per GPU [R]: frozen bf16 weights / (tp·pp) + per task LoRA params (bf16) + fp32 grads
  + Adam (12 B) on the adapters / (tp·pp) + activations (``MemoryModel.per_token_bytes``: 34·h
  bytes per token and layer / tp, 1F1B in-flight micro-batches, fp32 logits). ``max_tokens`` is
  the largest power of two that fits, at most ``cap``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from impl.common.api import ConfigError
from impl.common.cost.transformer import layer_matrix_params, layer_split, model_params
from impl.common.cost.varlen_model import Layout, MemoryModel, analytic_seq_cost

from .cost import Scheme, TpCost

TP_DEGREES = (1, 2, 4, 8, 16)
PP_DEGREES = (1, 2, 4, 8)
LORA_MATRIX_FACTOR = 2.0 / 3.0
# Spec 4, Table 3 [S2] (per-GPU throughput, model not stated): 2K tokens unless noted.
TABLE3 = {(1, 1): 5.11, (2, 1): 4.30, (1, 8): 4.45, (2, 4): 4.27, (4, 2): 3.48, (8, 1): 2.79}
TABLE3_TP8_16K = 2.33
TP8_RATIO = TABLE3[(8, 1)] / TABLE3[(1, 1)]


@dataclass(frozen=True)
class SimCostKnobs:
    mfu: float
    comm_scale: float = -1.0  # < 0: calibrate to tp8_ratio
    tp8_ratio: float = TP8_RATIO
    lora_matrix_factor: float = LORA_MATRIX_FACTOR
    memory_reserve_bytes: float = 4 * 2**30
    act_bytes_per_token_layer: float = 34.0


def lora_params_per_layer(model, rank: int) -> int:
    """r·(d_in + d_out) over q, k, v, o, gate, up, down."""
    h, kv, f = model.hidden, model.kv_hidden, model.ffn_hidden
    dims = [(h, h), (h, kv), (h, kv), (h, h), (h, f), (h, f), (f, h)]
    return rank * sum(a + b for a, b in dims)


def _parts(model, tp: int, pp: int, hw, mfu: float) -> tuple[float, float, float, float]:
    """Per layer: attention a (s²), matrix compute b_c, communication b_x (s), latency c."""
    full = analytic_seq_cost(model, Layout(1, tp, pp), hw, mfu=mfu)
    n_layers = max(layer_split(model.num_layers, pp))
    b_c = 3.0 * 2.0 * layer_matrix_params(model) * n_layers / (tp * hw.peak_flops["bf16"] * mfu)
    return full.a / n_layers, b_c / n_layers, (full.b - b_c) / n_layers, full.c / n_layers


def tp_cost(model, tp: int, pp: int, hw, k: SimCostKnobs, comm_scale: float) -> TpCost:
    a, b_c, b_x, c = _parts(model, tp, pp, hw, k.mfu)
    n_layers = max(layer_split(model.num_layers, pp))
    # f is per layer of an L/pp-layer stage: the stage's p2p is spread over its layers.
    return TpCost((a, 0.0, b_c * k.lora_matrix_factor + b_x * comm_scale, 0.0, 0.0, c * comm_scale),
                  source=f"analytic (comm_scale {comm_scale:.3f}, stage {n_layers} layers)")


def _throughput(model, tp, pp, hw, k, scale, s=2048) -> float:
    sch = Scheme(tp, pp, s, tp_cost(model, tp, pp, hw, k, scale), model.num_layers)
    return sch.throughput_per_gpu()


def calibrate_comm_scale(model, hw, k: SimCostKnobs) -> float:
    """Bisection on the TP8/TP1 per-GPU throughput ratio at 2K (monotone in the scale)."""
    if k.comm_scale >= 0:
        return k.comm_scale
    base = _throughput(model, 1, 1, hw, k, 1.0)

    def ratio(x):
        return _throughput(model, 8, 1, hw, k, x) / base

    lo, hi = 0.0, 64.0
    if not ratio(hi) <= k.tp8_ratio <= ratio(lo):
        raise ConfigError(f"system.sim.tp8_ratio: {k.tp8_ratio} is outside the reachable range "
                          f"[{ratio(hi):.3f}, {ratio(lo):.3f}] for {model.name}")
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) > k.tp8_ratio else (lo, mid)
    return (lo + hi) / 2


def table3_check(model, hw, k: SimCostKnobs, scale: float) -> dict:
    """Predicted per-GPU throughput relative to TP1 at 2K next to Table 3's, per config."""
    base = _throughput(model, 1, 1, hw, k, scale)
    out = {}
    for (tp, pp), v in TABLE3.items():
        out[f"tp{tp}pp{pp}"] = {"sim": round(_throughput(model, tp, pp, hw, k, scale) / base, 3),
                                "paper": round(v / TABLE3[(1, 1)], 3)}
    out["tp8pp1@16K_vs_tp8@2K"] = {"sim": round(_throughput(model, 8, 1, hw, k, scale, s=16384)
                                                / _throughput(model, 8, 1, hw, k, scale), 3),
                                   "paper": round(TABLE3_TP8_16K / TABLE3[(8, 1)], 3)}
    return out


def max_tokens(model, tp: int, pp: int, hw, k: SimCostKnobs, num_tasks: int, rank: int, cap: int) -> int:
    """Largest power of two of tokens one micro-batch may hold (0 when the weights do not fit)."""
    shard = tp * pp
    weights = 2.0 * model_params(model) / shard
    lora = lora_params_per_layer(model, rank) * model.num_layers * num_tasks / shard
    states = weights + lora * (2.0 + 4.0 + 12.0)
    mem = MemoryModel(capacity_bytes=hw.memory_bytes - k.memory_reserve_bytes,
                      act_bytes_per_token_layer=k.act_bytes_per_token_layer)
    room = mem.capacity_bytes - states
    if room <= 0:
        return 0
    fit = int(room // mem.per_token_bytes(model, Layout(1, tp, pp)))
    if fit < 1:
        return 0
    return min(cap, 1 << int(math.floor(math.log2(fit))))


def sim_schemes(model, hw, k: SimCostKnobs, num_gpus: int, num_tasks: int, rank: int, cap: int,
                min_tokens: int = 256) -> tuple[list[Scheme], float]:
    """Every (tp, pp) of the grid that fits ``num_gpus`` GPUs and >= ``min_tokens`` tokens, and
    the comm scale used. TP stays inside a node unless tp = 16 (the paper's 70B TP16)."""
    scale = calibrate_comm_scale(model, hw, k)
    out = []
    for tp in TP_DEGREES:
        for pp in PP_DEGREES:
            if tp * pp > num_gpus or pp > model.num_layers:
                continue
            m = max_tokens(model, tp, pp, hw, k, num_tasks, rank, cap)
            if m < min_tokens:
                continue
            out.append(Scheme(tp, pp, m, tp_cost(model, tp, pp, hw, k, scale), model.num_layers))
    return out, scale
