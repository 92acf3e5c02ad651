"""Hybrid-parallel (DP x TP x PP) cost model over a :class:`~impl.common.parallel.plan.Plan`
reused by Malleus, Elastor, Hydraulis, HotSPa and LobRA.

- t_layer(tp): the Megatron step model's forward + backward of one layer for one micro-batch of
  b x s tokens on a TP group of ``tp`` (:func:`impl.common.megatron.step.layer_time_s`: GEMMs and
  causal attention at the profile's kernel tables, memory-bound kernels, four TP collectives on
  the step model's bus bandwidth, the per-layer overhead); a measured ``sim_layer_time_s`` at the
  nominal tp replaces it (other sizes scale by tp / size plus the step model's collectives).
- alpha_k = t_layer(tp/2^k) / t_layer(tp).
- A stage's time per micro-batch = (max x over its GPUs) * layers * t_layer(group size).
- Pipeline i: T_i = (m_i + S_i - 1) * max_j stage_ij + 2 (S_i - 1) P2P messages (fill + drain);
  ``workload.pipeline_bubble=stagewise``: max_j (m_i stage_ij + sum_{k<j} stage_ik) instead
  (the same for equal stages; what the 1F1B runtime pays with a heterogeneous pipeline).
- Iteration = max_i T_i + gradient synchronisation: ZeRO reduce-scatter + all-gather (ring,
  2(n-1)/n * shard bytes) per layer over its n holders, the GPU with most bytes gating, at the
  inter-node bandwidth when the holders span nodes.
Every figure carries its unit in the name (``_s``, ``_bytes``, ``_mb``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from impl.common.api import ConfigError
from impl.common.cost.comm import ring_allreduce_time_s
from impl.common.cost.transformer import bytes_per_elem, layer_matrix_params

from .plan import Plan
from impl.common.megatron.derive import step_knobs, bus_bw

MB = 1024.0 * 1024.0
PIPELINE_BUBBLES = ("spec", "stagewise")


@dataclass(frozen=True)
class HybridCostModel:
    """Per-layer costs of one workload on one hardware profile."""

    model: object
    micro_batch_size: int
    dtype: str
    tp: int
    hw: object  # the hardware profile the step model prices
    intra_bw_bytes_per_s: float
    intra_lat_s: float
    inter_bw_bytes_per_s: float
    inter_lat_s: float
    # Profiled fwd + bwd of one layer per micro-batch at TP ``tp`` (replaces the step model's).
    measured_layer_s: Optional[float] = None
    pipeline_bubble: str = "spec"  # spec | stagewise (workload.pipeline_bubble)

    @classmethod
    def build(cls, wl, hw) -> "HybridCostModel":
        bytes_per_elem(wl.dtype)
        if wl.dtype not in ("bf16", "fp16") and not getattr(wl, "sim_layer_time_s", None) and not hw.measured:
            raise ConfigError(f"workload.dtype: {wl.dtype} on datasheet profile {hw.name}: the Megatron step model "
                              f"prices bf16/fp16 steps (give workload.sim_layer_time_s, or a measured profile)")
        bubble = getattr(wl, "pipeline_bubble", "spec")
        if bubble not in PIPELINE_BUBBLES:
            raise ConfigError(f"workload.pipeline_bubble: unknown {bubble!r} (one of: {', '.join(PIPELINE_BUBBLES)})")
        return cls(wl.model, wl.micro_batch_size, wl.dtype, wl.tp, hw,
                   bus_bw(hw, True), hw.intra_node_latency_s,
                   bus_bw(hw, False), hw.inter_node_latency_s,
                   getattr(wl, "sim_layer_time_s", None), bubble)

    @property
    def act_bytes(self) -> float:
        m = self.model
        return float(self.micro_batch_size * m.seq_len * m.hidden * bytes_per_elem(self.dtype))

    def step_layer_s(self, tp_size: int) -> float:
        """The step model's forward + backward of one layer for one micro-batch on ``tp_size`` GPUs."""
        from impl.common.megatron.model import MegatronModel
        from impl.common.megatron.step import layer_time_s

        rows = float(self.micro_batch_size * self.model.seq_len)
        return layer_time_s(MegatronModel.from_shape(self.model), tp_size, rows, rows * self.model.seq_len, self.hw)

    def layer_time_s(self, tp_size: int) -> float:
        """Forward + backward of one layer for one micro-batch on a TP group of ``tp_size``."""
        if not self.measured_layer_s:
            return self.step_layer_s(tp_size)
        # A profile at the nominal TP already holds that degree's all-reduces.
        if tp_size == self.tp:
            return float(self.measured_layer_s)
        compute = self.measured_layer_s * self.tp / tp_size
        ar = ring_allreduce_time_s(self.act_bytes, tp_size, self.intra_bw_bytes_per_s, self.intra_lat_s)
        return compute + 4.0 * ar

    def alpha(self, levels: int = 4) -> list[float]:
        base = self.layer_time_s(self.tp)
        out = []
        for k in range(levels):
            size = self.tp // (2 ** k)
            if size < 1:
                break
            out.append(self.layer_time_s(size) / base)
        return out

    def p2p_s(self, same_node: bool) -> float:
        bw, lat = (self.intra_bw_bytes_per_s, self.intra_lat_s) if same_node else (self.inter_bw_bytes_per_s, self.inter_lat_s)
        return lat + self.act_bytes / bw

    def layer_grad_bytes(self) -> float:
        return float(layer_matrix_params(self.model) * bytes_per_elem(self.dtype))


@dataclass(frozen=True)
class StageMemoryRows:
    """Per-GPU memory of a stage (the memory constraint of Malleus's planner, the authors' code:
    Hetu `python/hetu/engine/strategy.py`) as the planner's linear rows:
    (k_d * l + E * [first or last]) * r + X <= C. Not a second memory model: :func:`memory_model`
    fills the rows from the Megatron step model's terms.

    k_d = state_mb_per_layer + act_mb_per_layer_mb * min(d, inflight_cap): a stage d stages
    from the end holds d micro-batches in flight under 1F1B; r = tp / group size.
    """

    state_mb_per_layer: float
    act_mb_per_layer_mb: float
    embed_mb: float
    extra_mb: float
    capacity_mb: float
    inflight_cap: int = 1 << 30

    def k_mb(self, d: int) -> float:
        return self.state_mb_per_layer + self.act_mb_per_layer_mb * min(d, self.inflight_cap)

    def stage_mb(self, stages: int, stage: int, layers: int, ratio: float) -> float:
        d = stages - stage
        ends = 1.0 if stage in (0, stages - 1) else 0.0
        return (self.k_mb(d) * layers + self.embed_mb * ends) * ratio + self.extra_mb

    def fits(self, stages: int, stage: int, layers: int, ratio: float) -> bool:
        return self.stage_mb(stages, stage, layers, ratio) <= self.capacity_mb + 1e-9

    def max_layers(self, stages: int, stage: int, ratio: float) -> int:
        d = stages - stage
        ends = 1.0 if stage in (0, stages - 1) else 0.0
        room = (self.capacity_mb - self.extra_mb) / ratio - self.embed_mb * ends
        return max(int(math.floor(room / self.k_mb(d) + 1e-9)), 0) if room > 0 else 0

    def row(self, stages: int, stage: int, ratio: float) -> tuple[float, float, float]:
        """(coefficient of l, constant, capacity) of the stage's memory row, as the ILP writes it."""
        d = stages - stage
        ends = 1.0 if stage in (0, stages - 1) else 0.0
        return self.k_mb(d) * ratio, self.embed_mb * ends * ratio + self.extra_mb, self.capacity_mb


def memory_model(wl, hw) -> Optional[StageMemoryRows]:
    """The planner's memory rows from the Megatron step model's terms (one memory model) at the
    nominal TP degree, in MB: per layer the states (bf16 parameters, fp32 gradients, fp32 master
    + Adam over the dp replicas) and one micro-batch's activations by module x the profile's
    ``activation_factor``; E the larger of the first stage's embedding and the last stage's LM
    head with its logits; X the profile's ``memory_overhead_bytes``; C its allocatable bytes (or
    memory - ``workload.memory.headroom_mb``)."""
    mem = getattr(wl, "memory", None)
    if mem is None or not mem.enabled:
        return None
    from impl.common.megatron import activations as act
    from impl.common.megatron.model import MegatronModel, padded_vocab

    k = step_knobs(hw)
    m = MegatronModel.from_shape(wl.model)
    tp, sp = wl.tp, bool(mem.sequence_parallel)
    if m.heads % tp:
        raise ConfigError(f"workload.tp: {tp} does not divide the {m.heads} attention heads")
    rows = float(wl.micro_batch_size * wl.model.seq_len)
    per_param = 2.0 + 4.0 + 12.0 / max(1, wl.dp)
    state = per_param * m.layer_params_per_tp_rank(tp)
    layer_act = act.per_token_layer(m, tp, sp, m.dropout) * rows * k.activation_factor
    V = padded_vocab(m.vocab, tp, m.make_vocab_size_divisible_by)
    table = per_param * V // tp * m.hidden
    first = table + sum(act.embedding_bytes(m, tp, sp, m.dropout).values()) * rows * k.activation_factor * wl.pp
    last = (0.0 if m.tied else table) + (sum(act.head_bytes(m, tp, sp).values()) * rows * k.activation_factor
                                         + k.logits_bytes * rows * V / tp)
    if mem.headroom_mb is not None:
        if not 0 <= mem.headroom_mb * MB < hw.memory_bytes:
            raise ConfigError(f"workload.memory.headroom_mb: {mem.headroom_mb} must be in [0, {hw.memory_bytes / MB:.0f})")
        cap = hw.memory_bytes - mem.headroom_mb * MB
    else:
        cap = k.allocatable_bytes or hw.memory_bytes
    return StageMemoryRows(state_mb_per_layer=state / MB, act_mb_per_layer_mb=layer_act / MB, embed_mb=max(first, last) / MB,
                       extra_mb=k.memory_overhead_bytes / MB, capacity_mb=cap / MB,
                       inflight_cap=mem.inflight_cap or (1 << 30))


@dataclass(frozen=True)
class IterationCost:
    iteration_time_s: float
    pipeline_s: tuple[float, ...]
    compute_bound_s: float  # max_i m_i * max_j stage time (Z in seconds)
    grad_sync_s: float
    gpu_compute_s: dict  # device -> its own compute time this iteration (what x is measured from)


def iteration_cost(plan: Plan, x: Sequence[float], cm: HybridCostModel) -> IterationCost:
    """Simulated iteration time of ``plan`` when GPU g runs at 1/x[g] of nominal speed."""
    pipes, zsec, gpu_compute = [], 0.0, {}
    t_cache: dict[int, float] = {}

    def t_layer(size: int) -> float:
        if size not in t_cache:
            t_cache[size] = cm.layer_time_s(size)
        return t_cache[size]

    for p in plan.pipelines:
        stage_s = []
        for g, n in zip(p.groups, p.layers):
            grp = plan.groups[g]
            stage_s.append(max(x[d] for d in grp.gpus) * n * t_layer(grp.size))
            for d in grp.gpus:
                gpu_compute[d] = x[d] * n * t_layer(grp.size) * p.micro_batches
        slow = max(stage_s)
        p2p = 0.0
        for j in range(p.num_stages - 1):
            same = plan.groups[p.groups[j]].node == plan.groups[p.groups[j + 1]].node
            p2p += 2.0 * cm.p2p_s(same)
        if cm.pipeline_bubble == "stagewise":
            fill = max(p.micro_batches * t + sum(stage_s[:j]) for j, t in enumerate(stage_s))
        else:
            fill = (p.micro_batches + p.num_stages - 1) * slow
        pipes.append(fill + p2p)
        zsec = max(zsec, p.micro_batches * slow)
    sync = grad_sync_s(plan, cm)
    return IterationCost(max(pipes) + sync, tuple(pipes), zsec, sync, gpu_compute)


def grad_sync_s(plan: Plan, cm: HybridCostModel) -> float:
    """ZeRO reduce-scatter + all-gather of every layer's gradients over its holders."""
    if plan.dp <= 1:
        return 0.0
    holders: list[list[int]] = [[] for _ in range(plan.num_layers)]
    for p in plan.pipelines:
        for g, (lo, hi) in zip(p.groups, p.layer_ranges()):
            for layer in range(lo, hi):
                holders[layer].append(g)
    per_gpu: dict[int, float] = {}
    layer_bytes = cm.layer_grad_bytes()
    for groups in holders:
        n = len(groups)
        if n <= 1:
            continue
        nodes = {plan.groups[g].node for g in groups}
        bw = cm.intra_bw_bytes_per_s if len(nodes) == 1 else cm.inter_bw_bytes_per_s
        for g in groups:
            shard = layer_bytes / plan.groups[g].size
            t = 2.0 * (n - 1) / n * shard / bw
            for d in plan.groups[g].gpus:
                per_gpu[d] = per_gpu.get(d, 0.0) + t
    lat = 2 * (plan.dp - 1) * cm.inter_lat_s
    return (max(per_gpu.values()) + lat) if per_gpu else 0.0


def state_bytes_per_layer(cm: HybridCostModel) -> float:
    """What migrating one layer moves: bf16 params + fp32 master, Adam m and v (2 + 12 bytes per parameter)."""
    return float(layer_matrix_params(cm.model) * (bytes_per_elem(cm.dtype) + 12))
