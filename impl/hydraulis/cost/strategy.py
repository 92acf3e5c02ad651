"""Hydraulis strategy prices and planning memory, one pricing path (the authors' cost
model, `examples/hydraulis/strategy/`; our choices: ``impl/hydraulis/README.md``, "Design choices
for the [R] details").

A strategy ``k = (tp, pp)`` is priced per pipeline stage and packed micro-batch as
``T_mb = Σ_i (a s_i² + b s_i) + c`` in **milliseconds** (the authors' unit); a replica running
``v`` micro-batches under 1F1B takes ``Σ_j T_mb,j + (pp − 1)·max_j T_mb,j``.

Where the coefficients come from, in one code path (:meth:`ReplicaCost.from_seq_cost`):
- ``derived`` (default, every strategy): the Megatron step model's
  :func:`impl.common.cost.varlen_model.seq_cost` of the strategy's slowest stage (GEMMs and
  causal attention at the profile's kernel tables, TP collectives on its bus bandwidth, its fitted
  per-layer overhead), exactly, in ms;
- ``published`` (opt-in sensitivity input): the authors' 7B tables (80 GB and A100-40G),
  ``impl/hydraulis/data/coefficients.yaml``; strategies outside the table are dropped;
- ``fit``: real mode's least-squares :class:`~impl.common.cost.seqlen.SeqCost` (seconds).

Planning memory (:class:`StrategyMemory`): the shared step-model
:class:`impl.common.cost.varlen_model.MemoryModel` (states, activations by module, logits, the
profile's allocatable bytes) with ZeRO-1 over every GPU of the job: the optimizer states live in
the optimizer layout, which spreads them over all N GPUs whatever its (dp, tp, pp), so the layout
does not change a strategy's memory. ``maxlen`` is the unrounded longest micro-batch (the offline
generator's input, as in the authors' code); ``cap`` rounds it down to a multiple of 128 (planning).
"""
from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Optional, Sequence

from omegaconf import OmegaConf

from impl.common.api import ConfigError
from impl.common.cost.seqlen import SeqCost
from impl.common.cost.varlen_model import StrategyLayout, MemoryModel, seq_cost, split_heads
from impl.common.parallel.dims import ParallelDims
from impl.hydraulis.sim_config import CostSource

GIB = 2.0 ** 30
CAP_ROUND = 128
TP_DEGREES = (1, 2, 4, 8, 16)
PP_DEGREES = (1, 2, 4, 8)


@dataclass(frozen=True)
class ReplicaCost:
    """One replica's strategy and prices (ms): ``cap`` = most tokens per micro-batch,
    ``util`` = util_tp (fewest tokens that saturate a GPU)."""

    tp: int
    pp: int
    a: float
    b: float
    c: float
    cap: int
    util: int

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    def seq_cost(self, s: float) -> float:
        """One sequence's share of a micro-batch, ms (no constant c)."""
        return self.a * s * s + self.b * s

    def mb_time(self, lengths: Sequence[int]) -> float:
        """One packed micro-batch on one stage, ms: Σ seq_cost + c."""
        return sum(self.seq_cost(s) for s in lengths) + self.c

    def replica_time(self, micro_batches: Sequence[Sequence[int]]) -> float:
        """1F1B time of the replica's micro-batches (lists of lengths), ms; 0 with none."""
        ts = [self.mb_time(mb) for mb in micro_batches if len(mb)]
        return sum(ts) + (self.pp - 1) * max(ts) if ts else 0.0

    def label(self) -> str:
        return f"({self.tp},{self.pp})"

    @classmethod
    def from_seq_cost(cls, tp: int, pp: int, cost: SeqCost, cap: int, util: int) -> "ReplicaCost":
        """From a :class:`SeqCost` in seconds (fit or analytic) to the planner's ms."""
        return cls(tp=tp, pp=pp, a=cost.a * 1e3, b=cost.b * 1e3, c=cost.c * 1e3, cap=int(cap), util=int(util))


def fmt_strategy(replicas: Sequence[ReplicaCost]) -> str:
    """``4x(8,1) + (16,1)``: a replica list as one printable line (multiset, largest first)."""
    counts: dict[tuple[int, int], int] = {}
    for r in replicas:
        counts[(r.tp, r.pp)] = counts.get((r.tp, r.pp), 0) + 1
    keys = sorted(counts, key=lambda k: (-k[0] * k[1], -k[0]))
    return " + ".join((f"{counts[k]}x" if counts[k] > 1 else "") + f"({k[0]},{k[1]})" for k in keys)


# ---------------------------------------------------------------------------- data file


def default_path() -> pathlib.Path:
    return pathlib.Path(str(resources.files("impl.hydraulis").joinpath("data", "coefficients.yaml")))


@dataclass(frozen=True)
class CostData:
    published: tuple  # of (model, memory_gib, class, {(tp,pp): (a,b,c)})
    util_tp: dict  # class -> {tp: tokens}

    def memory_class(self, memory_bytes: float) -> str:
        """The util/published table of a GPU: 40gb at <= 48 GiB, else 80gb."""
        return "40gb" if memory_bytes <= 48 * GIB else "80gb"

    def published_table(self, model_name: str, memory_bytes: float) -> Optional[dict]:
        cls = self.memory_class(memory_bytes)
        for m, _, c, table in self.published:
            if m == model_name and c == cls:
                return table
        return None

    def util(self, tp: int, memory_bytes: float) -> int:
        table = self.util_tp[self.memory_class(memory_bytes)]
        if tp not in table:
            raise ConfigError(f"hydraulis util_tp: no entry for tp={tp} (have: {sorted(table)})")
        return int(table[tp])


def load_cost_data(path: Optional[str | pathlib.Path] = None) -> CostData:
    p = pathlib.Path(path) if path else default_path()
    return _load(str(p), p.stat().st_mtime_ns if p.exists() else 0)


def _key(text: str, where: str) -> tuple[int, int]:
    try:
        tp, pp = (int(x) for x in str(text).split(","))
    except ValueError:
        raise ConfigError(f"{where}: key {text!r} must be 'tp,pp'") from None
    if tp < 1 or pp < 1:
        raise ConfigError(f"{where}: key {text!r} needs tp, pp >= 1")
    return tp, pp


@lru_cache(maxsize=4)
def _load(path: str, _mtime: int) -> CostData:
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as exc:  # noqa: BLE001 - any read/parse failure is one line
        raise ConfigError(f"{path}: cannot load Hydraulis coefficients ({type(exc).__name__})") from None
    if not isinstance(raw, dict) or set(raw) != {"published", "util_tp"}:
        raise ConfigError(f"{path}: expected exactly the keys published, util_tp")
    pubs = []
    for i, e in enumerate(raw["published"]):
        where = f"{path}: published[{i}]"
        table = {}
        for k, v in e["coefficients"].items():
            if len(v) != 3 or any(float(x) < 0 for x in v):
                raise ConfigError(f"{where}.coefficients.{k}: need three non-negative numbers a, b, c, got {v}")
            table[_key(k, where)] = tuple(float(x) for x in v)
        pubs.append((str(e["model"]), float(e["memory_gib"]), str(e["gpu_memory_class"]), table))
    util = {str(c): {int(k): int(v) for k, v in t.items()} for c, t in raw["util_tp"].items()}
    return CostData(tuple(pubs), util)


# ---------------------------------------------------------------------------- planning memory


OptLayout = ParallelDims  # the optimizer (master weights + states) layout (os_dp, os_tp, os_pp)
ZERO_STAGES = (1, 3)


@dataclass
class StrategyMemory:
    """Per-GPU memory of one job's strategies, from the shared step-model
    :class:`~impl.common.cost.varlen_model.MemoryModel` (``zero1=True, sequence_parallel=True``)
    with the optimizer sharded over all ``num_gpus`` GPUs (the optimizer layout's spread).
    ``zero=3`` (DeepSpeed-like only, pp = 1) also shards the bf16 parameters and fp32 gradients
    over the N GPUs, from the same terms. Nothing here is a second price: every byte is the shared
    model's."""

    model: object
    hw: object
    num_gpus: int
    shared: MemoryModel
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def for_job(cls, model, hw, num_gpus: int) -> "StrategyMemory":
        return cls(model, hw, int(num_gpus), MemoryModel.for_hardware(hw, zero1=True, sequence_parallel=True))

    @property
    def capacity_bytes(self) -> float:
        """What one GPU may allocate (the step model's allocatable bytes)."""
        return self.shared.capacity_bytes

    def layout(self, tp: int, pp: int, parallel: str = "tp") -> StrategyLayout:
        return StrategyLayout(max(1, self.num_gpus // (tp * pp)), tp, pp, parallel)

    def _check_zero(self, pp: int, zero: int) -> None:
        if zero not in ZERO_STAGES:
            raise ConfigError(f"ZeRO stage {zero}: not supported (one of: 1, 3)")
        if zero == 3 and pp != 1:
            raise ConfigError(f"ZeRO-3 memory: only pp = 1 is modelled, got pp = {pp}")

    def bytes_at(self, tp: int, pp: int, tokens: int, parallel: str = "tp", zero: int = 1) -> float:
        """Peak bytes of the busiest GPU with a micro-batch of ``tokens`` in every in-flight slot."""
        self._check_zero(pp, zero)
        lay = self.layout(tp, pp, parallel)
        b = self.shared.bytes_at(self.model, lay, self.num_gpus, int(tokens))
        if zero == 3:
            st = self.shared.state_bytes(self.model, lay, self.num_gpus)
            b -= (st["params_bytes"] + st["grads_bytes"]) * (1.0 - 1.0 / self.num_gpus)
        return b

    def maxlen(self, tp: int, pp: int, parallel: str = "tp", zero: int = 1) -> int:
        """Longest micro-batch (tokens) that fits, unrounded; 0 when the states alone do not fit."""
        key = (tp, pp, parallel, zero)
        if key not in self._memo:
            self._check_zero(pp, zero)
            lay = self.layout(tp, pp, parallel)
            if zero == 1:
                self._memo[key] = int(self.shared.maxlen(self.model, lay, self.num_gpus))
            else:  # one stage: bytes_at is affine in the tokens
                room = self.capacity_bytes - self.bytes_at(tp, pp, 0, parallel, zero)
                self._memo[key] = max(0, int(math.floor(room / self.shared.per_token_bytes(self.model, lay))))
        return self._memo[key]

    def cap(self, tp: int, pp: int, parallel: str = "tp", zero: int = 1) -> int:
        """maxlen rounded down to a multiple of 128 (planning, as in the authors' code)."""
        return self.maxlen(tp, pp, parallel, zero) // CAP_ROUND * CAP_ROUND

    def fits(self, tp: int, pp: int, tokens: int, parallel: str = "tp", zero: int = 1) -> bool:
        return self.bytes_at(tp, pp, tokens, parallel, zero) <= self.capacity_bytes


# ---------------------------------------------------------------------------- strategy costs


@dataclass
class CostSpec:
    """How to price strategies: ``source`` derived (the Megatron step model, every strategy) or
    published (the authors' 7B coefficient table, an opt-in sensitivity input)."""

    source: str = "derived"
    tp_degrees: list = field(default_factory=lambda: list(TP_DEGREES))
    pp_degrees: list = field(default_factory=lambda: list(PP_DEGREES))


SOURCES = tuple(CostSource)


def check_source(source: str) -> None:
    if source not in SOURCES:
        raise ConfigError(f"system.sim.cost.source: unknown {source!r} (one of: {', '.join(SOURCES)})")


def strategy_cost(model, hw, mem: StrategyMemory, spec: CostSpec, tp: int, pp: int,
                  data: Optional[CostData] = None) -> Optional[ReplicaCost]:
    """One strategy priced per ``spec``, its cap from ``mem``; None when it cannot hold a
    128-token micro-batch, has more stages than layers, cannot be shaped by the step model (no
    head count both splits over tp and divides the hidden size, see below), or (source published)
    has no table entry."""
    check_source(spec.source)
    data = data or load_cost_data()
    table = None
    if spec.source == "published":
        table = data.published_table(model.name, hw.memory_bytes)
        if table is None:
            raise ConfigError(f"system.sim.cost.source: no published coefficients for {model.name} on "
                              f"{data.memory_class(hw.memory_bytes)} GPUs (only llama-7b); use derived")
        if (tp, pp) not in table:
            return None
    if pp > model.num_layers:
        return None
    if split_heads(model.heads, model.kv_heads, model.hidden, tp) is None:
        return None  # no head count both splits over tp and divides the hidden size: not a strategy
    cap = mem.cap(tp, pp)
    sc = seq_cost(model, StrategyLayout(1, tp, pp), hw) if table is None and cap >= CAP_ROUND else None
    if cap < CAP_ROUND:
        return None
    util = data.util(tp, hw.memory_bytes)
    if table is not None:
        a, b, c = table[(tp, pp)]
        return ReplicaCost(tp, pp, a, b, c, cap, util)
    return ReplicaCost.from_seq_cost(tp, pp, sc, cap, util)


def strategy_costs(model, hw, mem: StrategyMemory, spec: CostSpec, max_gpus: int,
                   data: Optional[CostData] = None) -> list[ReplicaCost]:
    """Every strategy (tp x pp over ``spec``'s degrees; with source published, the table's) that
    can hold at least one 128-token micro-batch, ordered by (gpus, tp)."""
    out = []
    for tp in spec.tp_degrees:
        for pp in spec.pp_degrees:
            if tp * pp > max_gpus:
                continue
            r = strategy_cost(model, hw, mem, spec, tp, pp, data)
            if r is not None:
                out.append(r)
    return sorted(out, key=lambda r: (r.gpus, r.tp))
