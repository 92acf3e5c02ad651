"""Paper-scale schemes for sim mode (ours, impl/lobra/README.md): f_tp(mbs, s) and max_tokens per (tp, pp).

Derived, not profiled (only 7B profiles ship with the authors' code). One stage's
micro-batch time is the Megatron step model's (:func:`impl.common.cost.varlen_model.seq_cost`:
GEMMs at the profile's kernel tables, causal attention, the TP collectives on the step model's
intra- or inter-node bus bandwidth, so TP 16 across two nodes is priced by it, the pipeline p2p,
the LM head on the last stage, per-layer overhead), with the GEMM terms scaled by
``lora_matrix_factor`` (2/3: frozen weights have no weight-gradient GEMMs): LoRA is a term on the
step model, not a second formula. No Table-3 rescaling: every Table-3 entry is a prediction
(:func:`table3_check`). The step model's per-iteration overhead is added once per optimizer step
by :mod:`impl.lobra.sim` (``system.sim.step_overhead_s``).
f is per layer of an L/pp-layer stage (fixed micro-batch part in c6, linear in mbs otherwise:
c1 = attention, c3 = matrices + collectives bandwidth, c2 = c4 = c5 = 0).

``max_tokens`` by the authors' profiling rule (Hetu ``examples/lobra/scripts/profile_memory.py``): for each
tp and each pp dividing the layers, mbs 1 with 2·pp micro-batches at lengths ``profile_lengths``
(1K..16K); max_tokens is the largest that fits. Memory per GPU [R]: frozen bf16 weights / (tp·pp)
+ per task LoRA params (bf16) + fp32 grads + Adam (12 B) on the adapters / (tp·pp) + activations
of the 1F1B in-flight micro-batches (stage 0 holds pp) + logits per token, by the step model's
:class:`~impl.common.cost.varlen_model.MemoryModel` (activations by module x the profile's
activation factor, its logit bytes and overhead, under its allocatable bytes).
"""
from __future__ import annotations

from dataclasses import dataclass

from impl.common.cost.transformer import model_params
from impl.common.cost.varlen_model import StrategyLayout, MemoryModel, seq_cost
from impl.common.megatron.derive import step_knobs

from impl.lobra.cost.replica import Scheme, TpCost

TP_DEGREES = (1, 2, 4, 8, 16)
MAX_PP = 8
PROFILE_LENGTHS = (1024, 2048, 4096, 8192, 16384)  # Hetu examples/lobra/scripts/profile_memory.py
LORA_MATRIX_FACTOR = 2.0 / 3.0
# Paper appendix, Table 3 [P] (per-GPU throughput, model not stated): 2K tokens unless noted.
TABLE3 = {(1, 1): 5.11, (2, 1): 4.30, (1, 8): 4.45, (2, 4): 4.27, (4, 2): 3.48, (8, 1): 2.79}
TABLE3_TP8_16K = 2.33


@dataclass(frozen=True)
class SimCostKnobs:
    lora_matrix_factor: float = LORA_MATRIX_FACTOR
    profile_lengths: tuple = PROFILE_LENGTHS


def pp_degrees(model) -> list[int]:
    """Pipeline degrees the profiling rule tries: those dividing the layers, up to MAX_PP."""
    return [p for p in range(1, MAX_PP + 1) if model.num_layers % p == 0]


def lora_params_per_layer(model, rank: int) -> int:
    """r·(d_in + d_out) over q, k, v, o, gate, up, down."""
    h, kv, f = model.hidden, model.kv_hidden, model.ffn_hidden
    dims = [(h, h), (h, kv), (h, kv), (h, h), (h, f), (h, f), (f, h)]
    return rank * sum(a + b for a, b in dims)


def tp_cost(model, tp: int, pp: int, hw, k: SimCostKnobs) -> TpCost:
    sc = seq_cost(model, StrategyLayout(1, tp, pp), hw, gemm_scale=k.lora_matrix_factor)
    per = model.num_layers / pp  # Scheme.t multiplies f by L/pp
    return TpCost((sc.a / per, 0.0, sc.b / per, 0.0, 0.0, sc.c / per),
                  source=f"megatron step model ({hw.name}, LoRA GEMMs x {k.lora_matrix_factor:.3f})")


def _throughput(model, tp, pp, hw, k, s=2048) -> float:
    sch = Scheme(tp, pp, s, tp_cost(model, tp, pp, hw, k), model.num_layers)
    return sch.throughput_per_gpu()


def table3_check(model, hw, k: SimCostKnobs) -> dict:
    """Predicted per-GPU throughput relative to TP1 at 2K next to Table 3's, per config."""
    base = _throughput(model, 1, 1, hw, k)
    out = {}
    for (tp, pp), v in TABLE3.items():
        out[f"tp{tp}pp{pp}"] = {"sim": round(_throughput(model, tp, pp, hw, k) / base, 3),
                                "paper": round(v / TABLE3[(1, 1)], 3)}
    out["tp8pp1@16K_vs_tp8@2K"] = {"sim": round(_throughput(model, 8, 1, hw, k, s=16384)
                                                / _throughput(model, 8, 1, hw, k), 3),
                                   "paper": round(TABLE3_TP8_16K / TABLE3[(8, 1)], 3)}
    return out


def memory_model(hw, k: SimCostKnobs) -> MemoryModel:
    """The shared per-GPU memory model (the step model's terms)."""
    return MemoryModel.for_hardware(hw)


def peak_bytes(model, tp: int, pp: int, hw, k: SimCostKnobs, num_tasks: int, rank: int, tokens: int) -> float:
    """Peak per GPU of mbs 1 at ``tokens`` with 2·pp micro-batches (stage 0 holds pp of them)."""
    shard = tp * pp
    weights = 2.0 * model_params(model) / shard
    lora = lora_params_per_layer(model, rank) * model.num_layers * num_tasks / shard
    mem = memory_model(hw, k)
    fixed = weights + lora * (2.0 + 4.0 + 12.0) + step_knobs(hw).memory_overhead_bytes  # as the step model's fixed part
    return fixed + tokens * mem.per_token_bytes(model, StrategyLayout(1, tp, pp))


def max_tokens(model, tp: int, pp: int, hw, k: SimCostKnobs, num_tasks: int, rank: int, cap: int) -> int:
    """The profiling rule: the largest of ``profile_lengths`` (<= ``cap``) that fits; 0: none."""
    room = memory_model(hw, k).capacity_bytes
    fit = [s for s in sorted(k.profile_lengths) if s <= cap
           and peak_bytes(model, tp, pp, hw, k, num_tasks, rank, s) <= room]
    return fit[-1] if fit else 0


def sim_schemes(model, hw, k: SimCostKnobs, num_gpus: int, num_tasks: int, rank: int, cap: int) -> list[Scheme]:
    """Every (tp, pp) of the grid that fits ``num_gpus`` GPUs and holds one of the profile
    lengths. TP stays inside a node unless tp = 16 (the paper's 70B TP16)."""
    out = []
    for tp in TP_DEGREES:
        for pp in pp_degrees(model):
            if tp * pp > num_gpus:
                continue
            m = max_tokens(model, tp, pp, hw, k, num_tasks, rank, cap)
            if m < 1:
                continue
            out.append(Scheme(tp, pp, m, tp_cost(model, tp, pp, hw, k), model.num_layers))
    return out
