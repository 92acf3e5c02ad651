"""Per-strategy costs of variable-length LLM training (HotSPa's strategy planning [R],
impl/hotspa/README.md; Hydraulis and LobRA reuse them), all from the Megatron step model
(:mod:`impl.common.megatron.step`): the time of one packed micro-batch on one pipeline stage as a
:class:`~impl.common.cost.seqlen.SeqCost` ``a·Σs² + b·s + c``, the memory per GPU, and the longest
micro-batch (``maxlen``) a strategy fits.

Time (:func:`seq_cost`): :func:`impl.common.megatron.step.seq_cost_terms`, the step model's
slowest stage of one packed micro-batch (GEMMs and causal attention at the profile's kernel
tables, memory-bound kernels over HBM, TP collectives or Ulysses all-to-alls on the step model's
bus bandwidth, pipeline p2p, the LM head, per-layer overhead) as a chord between half and twice
the typical length. ``parallel="tp"``: Megatron TP with sequence parallelism; ``"ulysses"``:
DeepSpeed-Ulysses sequence parallelism of degree tp (the layout's tp slot). A planner's uneven
layer split prices its slowest stage (``ceil(L/pp)`` layers).

Memory (:class:`MemoryModel`): the step model's memory terms (:func:`impl.common.megatron.step.linear_memory`)
for one micro-batch of s tokens per 1F1B in-flight slot: bf16 parameters and fp32 gradients of
the rank's shard, fp32 master + Adam over the data-parallel replicas (ZeRO-1), activations by
module (:mod:`impl.common.megatron.activations`) x the profile's ``activation_factor``, the
last stage's logits x ``logits_bytes``, under the profile's allocatable bytes less its fixed
overhead. A switch between two strategies holds both layouts' parameters and gradients for a
moment (:func:`MemoryModel.switch_peak_bytes`); activations are freed by then.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from impl.common.api import ConfigError
from impl.common.hardware import HardwareProfile

from impl.common.megatron.derive import step_knobs
from impl.common.megatron.model import MegatronLayout, MegatronModel
from impl.common.megatron.step import linear_memory, seq_cost_terms

from .seqlen import SeqCost

PARALLEL = ("tp", "ulysses")


@dataclass(frozen=True)
class StrategyLayout:
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


def split_heads(heads: int, kv_heads: int, hidden: int, degree: int) -> tuple[int, int] | None:
    """The nearest (heads, key/value heads) at or above the model's that ``degree`` splits and
    whose head count divides ``hidden``; None when there is none."""
    h = next((h for h in range(heads, hidden + 1) if h % degree == 0 and hidden % h == 0), None)
    if h is None:
        return None
    kv = 0
    if kv_heads:  # the nearest count (at or above the scaled one) that divides h and meets the degree
        kv = max(1, round(kv_heads * h / heads))
        while h % kv or (kv % degree and degree % kv):
            kv += 1
    return h, kv


def _splittable_heads(m, degree: int):
    split = split_heads(m.heads, m.kv_heads, m.hidden, degree)
    if split is None:
        raise ConfigError(f"layout: a degree of {degree} cannot split the heads of hidden {m.hidden} ({m.heads} heads)")
    return dataclasses.replace(m, heads=split[0], kv_heads=split[1])


def _step_shape(model, layout: StrategyLayout, hw: HardwareProfile, sequence_parallel: bool = True):
    """The harness shape as the step model's model and layout (one replica's slowest stage)."""
    m = MegatronModel.from_shape(model, context=int(getattr(model, "seq_len", 0) or 0))
    if m.num_layers % layout.pp:
        # Planners here split layers unevenly (layer_split): the slowest stage holds ceil(L/pp)
        # layers, which is the stage a SeqCost describes; price a model of pp such stages.
        m = dataclasses.replace(m, num_layers=math.ceil(m.num_layers / layout.pp) * layout.pp)
    if m.heads % layout.tp:
        # Some planners' pools list a tp that does not divide the heads (Megatron would refuse
        # it); the attention work is heads x head_dim = hidden either way, so price the nearest
        # head count that splits and divides hidden (the key/value count scaled to it).
        m = _splittable_heads(m, layout.tp)
    uly = layout.parallel == "ulysses"
    lay = MegatronLayout(dp=layout.dp, tp=1 if uly else layout.tp, ulysses=layout.tp if uly else 1, pp=layout.pp,
                         mbs=1, gbs=layout.dp, context=max(1, m.max_position_embeddings),
                         sequence_parallel=sequence_parallel and not uly, gpus_per_node=hw.gpus_per_node)
    return m, lay


def seq_cost(model, layout: StrategyLayout, hw: HardwareProfile, gemm_scale: float = 1.0,
             typical: float | None = None, sequence_parallel: bool = True) -> SeqCost:
    """Time of one packed micro-batch (forward + backward) on the slowest pipeline stage, from the
    step model (see the module doc). ``gemm_scale``: LoRA's frozen base has no weight-gradient
    GEMMs (2/3). ``sequence_parallel`` (Megatron TP only): norms and residuals on s / tp tokens,
    as :class:`MemoryModel` keeps their activations; off, whole on every TP rank."""
    m, lay = _step_shape(model, layout, hw, sequence_parallel)
    a, b, c = seq_cost_terms(m, lay, hw, gemm_scale=gemm_scale, typical=typical)
    return SeqCost(a=a, b=b, c=c, r2=1.0, source="megatron-step")


@dataclass(frozen=True)
class MemoryModel:
    """Per-GPU memory of a layout from the step model's terms; ``capacity_bytes`` is what one GPU
    may allocate (the profile's allocatable bytes)."""

    hw: HardwareProfile
    zero1: bool = True
    sequence_parallel: bool = True  # False: Megatron TP without SP (norms and residuals whole on every rank)
    # None: the step model's allocatable bytes (fitted to Megatron-LM's OOM verdicts, or carried:
    # the GPU's memory less the fitted headroom); else memory_bytes - headroom_bytes (a system
    # whose allocator keeps a different headroom; a sensitivity input).
    headroom_bytes: Optional[float] = None

    @classmethod
    def for_hardware(cls, hw: HardwareProfile, **kw) -> "MemoryModel":
        h = kw.get("headroom_bytes")
        if h is not None and not 0 <= h < hw.memory_bytes:
            raise ConfigError(f"memory headroom: {h:.3g} B must be in [0, {hw.memory_bytes:.3g}) (hardware {hw.name} memory)")
        return cls(hw=hw, **kw)

    @property
    def capacity_bytes(self) -> float:
        if self.headroom_bytes is not None:
            return float(self.hw.memory_bytes - self.headroom_bytes)
        k = step_knobs(self.hw)
        return float(k.allocatable_bytes or self.hw.memory_bytes)

    def _lines(self, model, layout: StrategyLayout, num_gpus: int = 0) -> list[tuple[float, float]]:
        """The step model's (fixed, per-token) bytes per stage; ZeRO-1 shards the optimizer over
        every replica of the ``num_gpus`` (default: the layout's own)."""
        m, lay = _step_shape(model, layout, self.hw)
        dp = max(1, num_gpus // (layout.tp * layout.pp)) if num_gpus else layout.dp
        lay = lay.with_(dp=dp, gbs=dp, sequence_parallel=self.sequence_parallel and layout.parallel == "tp",
                        distributed_optimizer=self.zero1)
        return linear_memory(m, lay, step_knobs(self.hw))

    def state_bytes(self, model, layout: StrategyLayout, num_gpus: int) -> dict[str, float]:
        """Model states of the busiest GPU: bf16 params, fp32 grads, fp32 master + Adam (ZeRO-1:
        over every GPU holding the same parameters)."""
        m, lay = _step_shape(model, layout, self.hw)
        p = float(max(m.params_per_rank(lay.tp, lay.pp)))
        holders = max(1, num_gpus // (lay.tp * lay.pp)) if self.zero1 else 1
        return {"params_bytes": 2.0 * p, "grads_bytes": 4.0 * p, "optimizer_bytes": 12.0 * p / holders}

    def per_token_bytes(self, model, layout: StrategyLayout) -> float:
        """Activation + logits bytes per token of a micro-batch in every in-flight slot, on the stage
        that holds most per token."""
        return max(per for _, per in self._lines(model, layout))

    def bytes_at(self, model, layout: StrategyLayout, num_gpus: int, seq_len: int) -> float:
        return max(f + per * seq_len for f, per in self._lines(model, layout, num_gpus))

    def maxlen(self, model, layout: StrategyLayout, num_gpus: int) -> int:
        """Longest packed micro-batch (tokens) that fits; 0 when the model states alone do not."""
        room = [(self.capacity_bytes - f) / per for f, per in self._lines(model, layout, num_gpus)]
        return max(0, int(math.floor(min(room))))

    def switch_peak_bytes(self, model, src: StrategyLayout, dst: StrategyLayout, num_gpus: int) -> float:
        """During a switch both layouts' params and grads coexist; the optimizer stays put."""
        a = self.state_bytes(model, src, num_gpus)
        b = self.state_bytes(model, dst, num_gpus)
        return a["optimizer_bytes"] + a["params_bytes"] + a["grads_bytes"] + b["params_bytes"] + b["grads_bytes"]
