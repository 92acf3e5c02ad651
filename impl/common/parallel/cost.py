"""Hybrid-parallel (DP x TP x PP) cost model over a :class:`~impl.common.parallel.plan.Plan`
reused by Malleus, Elastor, Hydraulis, HotSPa and LobRA.

- t_layer(tp): the Megatron step model's forward + backward of one layer for one micro-batch of
  b x s tokens on a TP group of ``tp`` (:func:`impl.common.megatron.step.layer_time_s`: GEMMs and
  causal attention at the profile's kernel tables, memory-bound kernels, four TP collectives
  priced by :mod:`impl.common.collectives`, the per-layer overhead); a measured ``sim_layer_time_s`` at the
  nominal tp replaces it (other sizes scale by tp / size plus the step model's collectives).
- alpha_k = t_layer(tp/2^k) / t_layer(tp).
- A stage's time per micro-batch = (max x over its GPUs) * layers * t_layer(group size).
- Pipeline i: T_i = (m_i + S_i - 1) * max_j stage_ij + 2 (S_i - 1) P2P messages (fill + drain);
  ``workload.pipeline_bubble=stagewise``: max_j (m_i stage_ij + sum_{k<j} stage_ik) instead
  (the same for equal stages; what the 1F1B runtime pays with a heterogeneous pipeline).
- Iteration = max_i T_i + gradient synchronisation: ZeRO reduce-scatter + all-gather (an
  all-reduce's bytes, :mod:`impl.common.collectives`) of each layer's shard over its n holders,
  the GPU with most bytes gating, over the NICs when the holders span nodes; + the step model's per-iteration terms
  (:func:`impl.common.megatron.step.optimizer_step_s`, one rule for every training system): Adam
  over the GPU's optimizer shard (each layer's parameters / its group size / its n holders; the
  GPU with most gating) and ``iteration_overhead_s``.
Every figure carries its unit in the name (``_s``, ``_bytes``, ``_mb``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from impl.common.api import ConfigError
from impl.common import collectives as coll
from impl.common.cost.comm import flow_rates, link_efficiencies, ring_allreduce_time_s
from impl.common.cost.transformer import bytes_per_elem, layer_matrix_params

from .plan import Plan
from impl.common.megatron.derive import step_knobs

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
    # Megatron sequence parallelism (``workload.memory.sequence_parallel``): the memory rows keep
    # norms and residuals on s / tp tokens, and so does the step model's layer time (same
    # collective bytes, as all-gathers + reduce-scatters).
    sequence_parallel: bool = False
    # step_layer_s by TP size: the planner and the simulator ask for a few sizes thousands of
    # times per job (a Malleus S5 job: ~2,800 calls, ~20 s of kernel-table interpolation).
    _layer_s: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def build(cls, wl, hw) -> "HybridCostModel":
        bytes_per_elem(wl.dtype)
        if wl.dtype not in ("bf16", "fp16") and not getattr(wl, "sim_layer_time_s", None) and not hw.measured:
            raise ConfigError(f"workload.dtype: {wl.dtype} on datasheet profile {hw.name}: the Megatron step model "
                              f"prices bf16/fp16 steps (give workload.sim_layer_time_s, or a measured profile)")
        bubble = getattr(wl, "pipeline_bubble", "spec")
        if bubble not in PIPELINE_BUBBLES:
            raise ConfigError(f"workload.pipeline_bubble: unknown {bubble!r} (one of: {', '.join(PIPELINE_BUBBLES)})")
        mem = getattr(wl, "memory", None)
        sp = bool(mem is not None and mem.enabled and mem.sequence_parallel)
        # One GPU's achieved rate on each link (a flow between two GPUs: NVLink, or ONE NIC
        # across nodes), for the re-sharding and migration flows that price themselves.
        intra_bw, inter_bw, intra_lat, inter_lat = flow_rates(hw)
        return cls(wl.model, wl.micro_batch_size, wl.dtype, wl.tp, hw, intra_bw, intra_lat, inter_bw, inter_lat,
                   getattr(wl, "sim_layer_time_s", None), bubble, sp)

    @property
    def act_bytes(self) -> float:
        m = self.model
        return float(self.micro_batch_size * m.seq_len * m.hidden * bytes_per_elem(self.dtype))

    def step_layer_s(self, tp_size: int) -> float:
        """The step model's forward + backward of one layer for one micro-batch on ``tp_size`` GPUs
        (with ``sequence_parallel``: norms and residuals on rows / tp_size tokens, the rows padded
        to a multiple of tp_size as Megatron pads them)."""
        if tp_size in self._layer_s:
            return self._layer_s[tp_size]
        from impl.common.megatron.model import MegatronModel
        from impl.common.megatron.step import layer_terms, theta_of

        rows = float(self.micro_batch_size * self.model.seq_len)
        sp = self.sequence_parallel and tp_size > 1
        if sp:
            rows = math.ceil(rows / tp_size) * tp_size
        f = layer_terms(MegatronModel.from_shape(self.model), tp_size, rows, rows * self.model.seq_len, self.hw,
                        self.hw.gpus_per_node, sequence_parallel=sp)
        self._layer_s[tp_size] = float(f @ theta_of(self.hw, step_knobs(self.hw)))
        return self._layer_s[tp_size]

    def layer_time_s(self, tp_size: int) -> float:
        """Forward + backward of one layer for one micro-batch on a TP group of ``tp_size``."""
        if not self.measured_layer_s:
            return self.step_layer_s(tp_size)
        # A profile at the nominal TP already holds that degree's all-reduces.
        if tp_size == self.tp:
            return float(self.measured_layer_s)
        compute = self.measured_layer_s * self.tp / tp_size
        ar = ring_allreduce_time_s(self.act_bytes, tp_size, self.hw)
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
        return coll.time_s(coll.CollOp.SEND_RECV, self.act_bytes, self.hw, 2, 2 if same_node else 1,
                           **link_efficiencies(self.hw))

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
    head (with pp > 1 a tied embedding's copy too, as the step model counts it) with its logits; X the profile's ``memory_overhead_bytes``; C its allocatable bytes (or
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
    # The end stages' parameters beyond their layers, as the step model counts them
    # (MegatronModel.params_per_rank): the embedding (GPT: and positions) on the first, the
    # final norm and the output layer on the last, which with pp > 1 holds its own copy of a
    # tied embedding (Megatron all-reduces the two copies' gradients).
    ends = dataclasses.replace(m, num_layers=min(wl.pp, 2))
    P = ends.params_per_rank(tp, min(wl.pp, 2))
    layer = m.layer_params_per_tp_rank(tp)
    emb_act = sum(act.embedding_bytes(m, tp, sp, m.dropout).values()) * rows * k.activation_factor * wl.pp
    head_act = sum(act.head_bytes(m, tp, sp).values()) * rows * k.activation_factor + k.logits_bytes * rows * V / tp
    if wl.pp == 1:  # one stage holds both ends (the rows add E once): both ends' bytes
        first = last = per_param * (P[0] - layer) + emb_act + head_act
    else:
        first = per_param * (P[0] - layer) + emb_act
        last = per_param * (P[-1] - layer) + head_act
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
    optimizer_s: float = 0.0  # the step model's per-iteration terms (Adam + iteration overhead)


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
    opt = optimizer_s(plan, cm)
    return IterationCost(max(pipes) + sync + opt, tuple(pipes), zsec, sync, gpu_compute, opt)


def _holders(plan: Plan) -> list[list[int]]:
    """Per layer, the groups (one per pipeline) that hold it."""
    holders: list[list[int]] = [[] for _ in range(plan.num_layers)]
    for p in plan.pipelines:
        for g, (lo, hi) in zip(p.groups, p.layer_ranges()):
            for layer in range(lo, hi):
                holders[layer].append(g)
    return holders


def optimizer_s(plan: Plan, cm: HybridCostModel) -> float:
    """The step model's per-iteration terms (:func:`impl.common.megatron.step.optimizer_step_s`)
    on the GPU with the largest optimizer shard: each layer it holds contributes the layer's
    parameters / its group size / the layer's holders (ZeRO over the replicas, as
    :func:`grad_sync_s` reduces)."""
    from impl.common.megatron.step import optimizer_step_s

    per_gpu: dict[int, float] = {}
    layer_params = float(layer_matrix_params(cm.model))
    for groups in _holders(plan):
        for g in groups:
            share = layer_params / plan.groups[g].size / len(groups)
            for d in plan.groups[g].gpus:
                per_gpu[d] = per_gpu.get(d, 0.0) + share
    return optimizer_step_s(max(per_gpu.values(), default=0.0), 1, cm.hw)


def grad_sync_s(plan: Plan, cm: HybridCostModel) -> float:
    """ZeRO reduce-scatter + all-gather of every layer's gradients over its holders."""
    if plan.dp <= 1:
        return 0.0
    holders = _holders(plan)
    per_gpu: dict[int, float] = {}
    layer_bytes = cm.layer_grad_bytes()
    eff = link_efficiencies(cm.hw)
    lat = 0.0
    for groups in holders:
        n = len(groups)
        if n <= 1:
            continue
        nodes = {plan.groups[g].node for g in groups}
        # each shard's ring: one rank per holder group; an uneven node split priced at one per node
        k = n // len(nodes) if n % len(nodes) == 0 and n // len(nodes) <= cm.hw.gpus_per_node else 1
        for g in groups:
            c = coll.collective(coll.CollOp.ALL_REDUCE, layer_bytes / plan.groups[g].size, cm.hw, n, k, **eff)
            lat = max(lat, c.latency_s)
            for d in plan.groups[g].gpus:
                per_gpu[d] = per_gpu.get(d, 0.0) + c.bandwidth_s
    return (max(per_gpu.values()) + lat) if per_gpu else 0.0


def state_bytes_per_layer(cm: HybridCostModel) -> float:
    """What migrating one layer moves: bf16 params + fp32 master, Adam m and v (2 + 12 bytes per parameter)."""
    return float(layer_matrix_params(cm.model) * (bytes_per_elem(cm.dtype) + 12))
