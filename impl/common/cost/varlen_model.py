"""Analytic per-strategy costs of variable-length LLM training (HotSPa 2.7 step 2 and 6;
Hydraulis and LobRA reuse them): the time of one packed micro-batch on one pipeline stage as a
:class:`~impl.common.cost.seqlen.SeqCost` ``a·Σs² + b·s + c``, the memory per GPU, and the
longest micro-batch (``maxlen``) a strategy fits.

Time of one micro-batch (forward + backward) on one stage of ``ceil(L/pp)`` layers [R]:
- compute: 3x the forward FLOPs (backward = 2x forward), forward per layer = 2·s·(matrix
  params) + 4·Σs²·h (attention per segment, varlen flash-attention), divided by the degree that
  splits the work (tp, or sp for Ulysses) and by ``peak · mfu``. Embeddings and LM head are not
  counted (under 3% of a 7B layer stack's FLOPs at vocab 32000).
- ``parallel="tp"`` (Megatron TP with sequence parallelism, HotSPa spec 6): 8 collectives of
  s·h·2 B per layer (forward + backward), ring factor (tp-1)/tp, on NVLink when the TP group
  sits inside a node, else on the per-GPU IB share; one latency each.
- ``parallel="ulysses"`` (DeepSpeed-Ulysses SP): 8 all-to-alls per layer (q, k, v, out in
  forward and backward); in each a GPU exchanges (sp-1)/sp of its s/sp·h·2 B slice.
- pipeline (pp > 1): one activation forward and one gradient backward per micro-batch and
  stage boundary, s·h·2 B / tp per rank, on the link between two stages.
No compute/communication overlap is assumed (conservative for every strategy alike).

Memory per GPU [R] (bf16 compute copies, fp32 gradient accumulators, Adam):
- parameters 2 B and gradients 4 B per parameter of the GPU's model shard (|θ|/(tp·pp); Ulysses
  does not shard parameters over sp: |θ|/pp);
- fp32 master + Adam m, v = 12 B per parameter, sharded over every data-parallel replica with
  ZeRO-1 (so 12·|θ|/N for any strategy of N GPUs), unsharded (12·|θ|/shard) without;
- activations under 1F1B: stage 0 keeps pp micro-batches of ceil(L/pp) layers in flight, each
  ``act_bytes_per_token_layer``·h bytes per token and layer, split by tp (or sp); the default
  34 is Korthikanti et al. 2022's per-layer count without the attention-score term (flash
  attention), with sequence parallelism (``sequence_parallel=False``: 10 of it stays whole on
  every TP rank, 10 + 24/tp);
- fp32 logits of the last stage, s·vocab·4 B / tp.
A switch between two strategies holds both layouts' parameters and gradients for a moment
(:func:`switch_peak_bytes`); activations are freed by then (the switch follows a backward).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from impl.common.api import ConfigError
from impl.common.hardware import HardwareProfile

from .comm import same_node
from .seqlen import SeqCost
from .transformer import layer_matrix_params, layer_split, model_params

PARALLEL = ("tp", "ulysses")
ACT_BYTES_PER_TOKEN_LAYER = 34.0  # x hidden; Korthikanti et al. 2022, flash attention, SP
# Of the 34: what tensor parallelism alone shards (attention and MLP internals); without sequence
# parallelism the other 10 (norm inputs, residuals, dropout masks) stay whole on every TP rank
# (Korthikanti et al. 2022 with flash attention: 10 + 24/t per token-layer vs 34/t with SP).
TP_SHARDED_ACT_BYTES = 24.0
TP_COLLECTIVES_PER_LAYER = 8  # HotSPa spec 6 (SP: 4 forward + 4 backward)


@dataclass(frozen=True)
class Layout:
    """A (dp, tp, pp) layout of ``num_gpus`` GPUs; with ``parallel="ulysses"`` the tp slot is
    the Ulysses sequence-parallel degree."""

    dp: int
    tp: int
    pp: int
    parallel: str = "tp"

    def __post_init__(self) -> None:
        if self.parallel not in PARALLEL:
            raise ConfigError(f"parallel: unknown {self.parallel!r} (one of: {', '.join(PARALLEL)})")
        if min(self.dp, self.tp, self.pp) < 1:
            raise ConfigError(f"layout ({self.dp},{self.tp},{self.pp}): degrees must be >= 1")

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def param_shard(self) -> int:
        """Ways the parameters are split across GPUs (Ulysses replicates them over sp)."""
        return self.tp * self.pp if self.parallel == "tp" else self.pp


def _link(hw: HardwareProfile, intra: bool) -> tuple[float, float]:
    bw = hw.intra_node_bw_bytes_per_s if intra else hw.inter_node_bw_bytes_per_s
    lat = hw.intra_node_latency_s if intra else hw.inter_node_latency_s
    return bw * hw.comm_efficiency, lat


def analytic_seq_cost(model, layout: Layout, hw: HardwareProfile, *, mfu: float | None = None,
                      dtype: str = "bf16") -> SeqCost:
    """Time of one packed micro-batch (forward + backward) on one pipeline stage; see the
    module doc for every term. A profile with fitted Megatron knobs (``hw.megatron``) prices a
    Megatron-TP layout through the calibrated step model instead (:func:`megatron_seq_cost`;
    ``mfu`` is then not used: the fitted GEMM and attention efficiencies are)."""
    if hw.megatron is not None and layout.parallel == "tp" and dtype == "bf16":
        return megatron_seq_cost(model, layout, hw)
    if dtype not in hw.peak_flops:
        raise ConfigError(f"hardware {hw.name}: no peak FLOP/s for dtype {dtype!r}")
    eff = hw.mfu if mfu is None else mfu
    if not 0 < eff <= 1:
        raise ConfigError(f"workload.mfu: must be in (0, 1], got {eff}")
    flops_per_s = hw.peak_flops[dtype] * eff
    n_layers = max(layer_split(model.num_layers, layout.pp))
    h, k = model.hidden, layout.tp
    a = 3.0 * 4.0 * h * n_layers / (k * flops_per_s)
    b = 3.0 * 2.0 * layer_matrix_params(model) * n_layers / (k * flops_per_s)
    c = 0.0
    if k > 1:
        bw, lat = _link(hw, k <= hw.gpus_per_node)
        per_token = h * 2.0 * (k - 1) / k
        if layout.parallel == "ulysses":
            per_token /= k  # a GPU holds s/sp tokens and keeps 1/sp of them
        b += n_layers * TP_COLLECTIVES_PER_LAYER * per_token / bw
        c += n_layers * TP_COLLECTIVES_PER_LAYER * lat
    if layout.pp > 1:
        bw, lat = _link(hw, same_node(0, 1, layout.tp, layout.dp, hw.gpus_per_node))
        b += 2.0 * h * 2.0 / (k * bw)
        c += 2.0 * lat
    return SeqCost(a=a, b=b, c=c, r2=1.0, source="analytic")


def megatron_seq_cost(model, layout: Layout, hw: HardwareProfile, sequence_parallel: bool = True,
                      gemm_scale: float = 1.0) -> SeqCost:
    """:func:`impl.common.megatron.step.seq_cost_terms` for a harness model shape."""
    from impl.common.megatron.model import MegatronLayout, MegatronModel
    from impl.common.megatron.step import seq_cost_terms

    import dataclasses
    import math as _m

    m = MegatronModel.from_shape(model, context=int(getattr(model, "seq_len", 0) or 0))
    if m.num_layers % layout.pp:
        # Planners here split layers unevenly (layer_split): the slowest stage holds ceil(L/pp)
        # layers, which is the stage a SeqCost describes; price a model of pp such stages.
        m = dataclasses.replace(m, num_layers=_m.ceil(m.num_layers / layout.pp) * layout.pp)
    if m.heads % layout.tp and not m.kv_heads:
        # Some planners' pools list a tp that does not divide the heads (Megatron would refuse
        # it); no cost term depends on the head count, so price it as if the heads split.
        m = dataclasses.replace(m, heads=layout.tp)
    lay = MegatronLayout(dp=layout.dp, tp=layout.tp, pp=layout.pp, mbs=1, gbs=layout.dp, context=max(1, m.max_position_embeddings),
                         sequence_parallel=sequence_parallel, gpus_per_node=hw.gpus_per_node)
    a, b, c = seq_cost_terms(m, lay, hw, gemm_scale=gemm_scale)
    return SeqCost(a=a, b=b, c=c, r2=1.0, source="megatron-calibrated")


@dataclass(frozen=True)
class MemoryModel:
    """Per-GPU memory of a layout; ``capacity_bytes`` is what one GPU may use."""

    capacity_bytes: float
    zero1: bool = True
    act_bytes_per_token_layer: float = ACT_BYTES_PER_TOKEN_LAYER
    sequence_parallel: bool = True  # False: Megatron TP without SP (10 + 24/tp per token-layer)
    # Of act_bytes_per_token_layer, the part TP splits without SP (the rest stays whole).
    tp_sharded_bytes: float = TP_SHARDED_ACT_BYTES
    logits_bytes: float = 4.0  # per logit element at the loss peak

    @classmethod
    def for_hardware(cls, hw: HardwareProfile, reserve_bytes: float = 0.0, **kw) -> "MemoryModel":
        """Capacity = memory - reserve. A profile with fitted Megatron knobs sets the capacity to
        its allocatable bytes (less its fixed overhead; the reserve is then not taken: the fit
        measured the headroom) and the activation and logit bytes to the fitted ones."""
        if reserve_bytes < 0 or reserve_bytes >= hw.memory_bytes:
            raise ConfigError(f"memory reserve: {reserve_bytes:.3g} B must be in [0, {hw.memory_bytes:.3g}) "
                              f"(hardware {hw.name} memory)")
        k = hw.megatron
        if k is not None:
            kw = {**kw, "act_bytes_per_token_layer": k.act_whole_bytes + k.act_sharded_bytes,
                  "tp_sharded_bytes": k.act_sharded_bytes, "logits_bytes": k.logits_bytes}
            return cls(capacity_bytes=k.allocatable_bytes - k.memory_overhead_bytes, **kw)
        return cls(capacity_bytes=hw.memory_bytes - reserve_bytes, **kw)

    def state_bytes(self, model, layout: Layout, num_gpus: int) -> dict[str, float]:
        """Model states of one GPU: bf16 params, fp32 grads, optimizer (master + Adam)."""
        p = float(model_params(model))
        opt_shard = num_gpus if self.zero1 else layout.param_shard
        return {"params_bytes": 2.0 * p / layout.param_shard, "grads_bytes": 4.0 * p / layout.param_shard,
                "optimizer_bytes": 12.0 * p / opt_shard}

    def per_token_bytes(self, model, layout: Layout) -> float:
        """Activation + logits bytes per token of the longest micro-batch on the busiest GPU."""
        n_layers = max(layer_split(model.num_layers, layout.pp))
        in_flight = layout.pp  # 1F1B: stage 0 holds pp micro-batches
        per_layer = self.act_bytes_per_token_layer / layout.tp
        if not self.sequence_parallel and layout.parallel == "tp":
            whole = max(0.0, self.act_bytes_per_token_layer - self.tp_sharded_bytes)
            per_layer = whole + (self.act_bytes_per_token_layer - whole) / layout.tp
        act = per_layer * model.hidden * n_layers * in_flight
        logits = self.logits_bytes * model.vocab / layout.tp
        return act + logits

    def bytes_at(self, model, layout: Layout, num_gpus: int, seq_len: int) -> float:
        return sum(self.state_bytes(model, layout, num_gpus).values()) + seq_len * self.per_token_bytes(model, layout)

    def maxlen(self, model, layout: Layout, num_gpus: int) -> int:
        """Longest packed micro-batch (tokens) that fits; 0 when the model states alone do not."""
        room = self.capacity_bytes - sum(self.state_bytes(model, layout, num_gpus).values())
        return max(0, int(math.floor(room / self.per_token_bytes(model, layout))))

    def switch_peak_bytes(self, model, src: Layout, dst: Layout, num_gpus: int) -> float:
        """During a switch both layouts' params and grads coexist; the optimizer stays put."""
        a = self.state_bytes(model, src, num_gpus)
        b = self.state_bytes(model, dst, num_gpus)
        return a["optimizer_bytes"] + a["params_bytes"] + a["grads_bytes"] + b["params_bytes"] + b["grads_bytes"]
