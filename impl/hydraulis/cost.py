"""Hydraulis cost and memory model (spec hydraulis 2.1, 6, 9).

A strategy ``k = (tp, pp)`` is priced per pipeline stage and packed micro-batch as
``T_mb = Σ_i (a s_i² + b s_i) + c`` in **milliseconds** (the authors' unit); a replica running
``v`` micro-batches under 1F1B takes ``Σ_j T_mb,j + (pp − 1)·max_j T_mb,j``.

Where the coefficients come from, in one code path (:meth:`ReplicaCost.from_seq_cost`):
- ``published``: the authors' 7B tables (80 GB and A100-40G), ``conf/data/hydraulis_coefficients.yaml``;
- ``derived`` (spec 6): :func:`impl.common.cost.varlen_model.analytic_seq_cost` (FLOPs / MFU plus
  8 TP collectives of s·h·2 B per layer, inter-node bandwidth when TP spans nodes), times
  ``causal`` for the attention term [R] (causal flash-attention computes half the score matrix:
  the published 7B table's a/b ratio is 0.52x the full-matrix FLOP ratio);
- ``fit``: real mode's least-squares :class:`~impl.common.cost.seqlen.SeqCost` (seconds).

Memory per GPU (spec 2.1): ``M(S) = L·(S·H/tp)·A_tp + P + gap`` with the model states
``P = (L/os_pp)(H²/os_tp)·B·α/os_dp + (L/pp)(H²/tp)·B·(1−α)`` plus the same split of the vocab
matrix (H·V elements, 32 B each when pp = 1, else 16); ``maxlen_k = (Mem − safe − P − gap) /
(L·H/tp·A_tp)``. Planning rounds it down to a multiple of 128 (``cap``); the offline generator
uses the unrounded value (spec 9).
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
from impl.common.parallel.dims import ParallelDims
from impl.common.cost.varlen_model import Layout, analytic_seq_cost

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
    return pathlib.Path(str(resources.files("conf").joinpath("data", "hydraulis_coefficients.yaml")))


@dataclass(frozen=True)
class MemoryParams:
    act_bytes_per_token: dict  # tp -> A_tp
    state_bytes_per_h2: float
    shardable_fraction: float
    vocab_bytes_pp1: float
    vocab_bytes_pp: float
    gap_gib: float
    safe_gib: dict  # model name -> GiB
    default_safe_gib: float

    def a_tp(self, tp: int) -> float:
        if tp not in self.act_bytes_per_token:
            raise ConfigError(f"hydraulis memory model: no A_tp for tp={tp} (have: {sorted(self.act_bytes_per_token)})")
        return float(self.act_bytes_per_token[tp])

    def safe_bytes(self, model_name: str) -> float:
        return float(self.safe_gib.get(model_name, self.default_safe_gib)) * GIB


@dataclass(frozen=True)
class CostData:
    published: tuple  # of (model, memory_gib, class, {(tp,pp): (a,b,c)})
    util_tp: dict  # class -> {tp: tokens}
    memory: MemoryParams

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
    if not isinstance(raw, dict) or set(raw) != {"published", "util_tp", "memory"}:
        raise ConfigError(f"{path}: expected exactly the keys published, util_tp, memory")
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
    m = raw["memory"]
    mem = MemoryParams(act_bytes_per_token={int(k): float(v) for k, v in m["act_bytes_per_token"].items()},
                       state_bytes_per_h2=float(m["state_bytes_per_h2"]),
                       shardable_fraction=float(m["shardable_fraction"]),
                       vocab_bytes_pp1=float(m["vocab_bytes_pp1"]), vocab_bytes_pp=float(m["vocab_bytes_pp"]),
                       gap_gib=float(m["gap_gib"]), safe_gib={str(k): float(v) for k, v in m["safe_gib"].items()},
                       default_safe_gib=float(m["default_safe_gib"]))
    return CostData(tuple(pubs), util, mem)


# ---------------------------------------------------------------------------- memory


OptLayout = ParallelDims  # the optimizer (master weights + states) layout (os_dp, os_tp, os_pp), spec 2.2


@dataclass(frozen=True)
class MemoryModel:
    """Spec 2.1's per-GPU memory model for one (model, GPU memory, optimizer layout)."""

    num_layers: int
    hidden: int
    vocab: int
    mem_bytes: float
    safe_bytes: float
    opt: OptLayout
    params: MemoryParams

    @classmethod
    def for_model(cls, model, mem_bytes: float, opt: OptLayout, data: Optional[CostData] = None,
                  safe_bytes: Optional[float] = None) -> "MemoryModel":
        data = data or load_cost_data()
        safe = data.memory.safe_bytes(model.name) if safe_bytes is None else float(safe_bytes)
        return cls(model.num_layers, model.hidden, model.vocab, float(mem_bytes), safe, opt, data.memory)

    def state_bytes(self, tp: int, pp: int) -> float:
        """P: model states on one GPU of a (tp, pp) replica."""
        mp, o = self.params, self.opt
        L, H, V = self.num_layers, self.hidden, self.vocab
        al, B = mp.shardable_fraction, mp.state_bytes_per_h2
        p = (L / o.pp) * (H * H / o.tp) * B * al / o.dp + (L / pp) * (H * H / tp) * B * (1 - al)
        bv = mp.vocab_bytes_pp1 if pp == 1 else mp.vocab_bytes_pp
        p += (H * V / o.tp) * bv * al / o.dp + (H * V / tp) * bv * (1 - al)
        return p

    def per_token_bytes(self, tp: int) -> float:
        return self.num_layers * self.hidden / tp * self.params.a_tp(tp)

    def bytes_at(self, tp: int, pp: int, tokens: int) -> float:
        """M(S) for a micro-batch of ``tokens``."""
        return tokens * self.per_token_bytes(tp) + self.state_bytes(tp, pp) + self.params.gap_gib * GIB

    def maxlen(self, tp: int, pp: int) -> float:
        """Unrounded longest micro-batch (tokens); <= 0 when the states alone do not fit."""
        room = self.mem_bytes - self.safe_bytes - self.state_bytes(tp, pp) - self.params.gap_gib * GIB
        return room / self.per_token_bytes(tp)

    def cap(self, tp: int, pp: int) -> int:
        """maxlen rounded down to a multiple of 128 (planning, spec 2.1)."""
        return max(0, int(math.floor(self.maxlen(tp, pp) / CAP_ROUND)) * CAP_ROUND)

    def fits(self, tp: int, pp: int, tokens: int) -> bool:
        return self.bytes_at(tp, pp, tokens) <= self.mem_bytes - self.safe_bytes


def default_opt_layout(num_gpus: int, gpus_per_node: int) -> OptLayout:
    """[R] The optimizer layout when none is given: TP over a node, DP over nodes (spec 2.2's
    examples (8,4,1) @32 and (64,16,1) @1024 are the authors' choices; ours is intra-node TP)."""
    tp = min(num_gpus, gpus_per_node)
    return OptLayout(num_gpus // tp, tp, 1)


# ---------------------------------------------------------------------------- strategy costs


@dataclass
class CostSpec:
    """How to price strategies: ``source`` auto (published table when there is one, else
    derived), published, or derived; ``causal`` scales the derived attention term."""

    source: str = "auto"
    mfu: float = 0.55
    causal: float = 0.5
    c_per_layer_ms: float = -1.0  # < 0: published_c_per_layer_ms
    tp_degrees: list = field(default_factory=lambda: list(TP_DEGREES))
    pp_degrees: list = field(default_factory=lambda: list(PP_DEGREES))


SOURCES = ("auto", "published", "derived")


def derived_seq_cost(model, tp: int, pp: int, hw, mfu: float, causal: float, c_per_layer_s: float = 0.0,
                     parallel: str = "tp") -> SeqCost:
    """Spec 6 derivation through the shared analytic model; the attention term is scaled by
    ``causal`` and a fixed overhead of ``c_per_layer_s`` per layer of the stage is added."""
    from impl.common.cost.transformer import layer_split

    base = analytic_seq_cost(model, Layout(1, tp, pp, parallel), hw, mfu=mfu, dtype="bf16")
    layers = max(layer_split(model.num_layers, pp))
    return SeqCost(a=base.a * causal, b=base.b, c=base.c + c_per_layer_s * layers, r2=1.0, source="analytic")


def published_c_per_layer_ms(data: CostData, num_layers_7b: int = 32, memory_bytes: float = 80 * GIB) -> float:
    """[R] The fixed per-micro-batch overhead per layer of a stage, ms: the mean of c_k / (L/pp_k)
    over the published 7B table of the GPU's memory class (80 GB: 1.4-2.2, mean 1.8). The
    FLOP-based derivation has no such term (its c is only collective latencies), so without it a
    derived model would price micro-batch counts as free."""
    table = data.published_table("llama-7b", memory_bytes) or data.published_table("llama-7b", 80 * GIB)
    vals = [c / (num_layers_7b / pp) for (tp, pp), (a, b, c) in table.items()]
    return sum(vals) / len(vals)


def strategy_cost(model, hw, mem: MemoryModel, spec: CostSpec, tp: int, pp: int,
                  data: Optional[CostData] = None) -> Optional[ReplicaCost]:
    """One strategy priced per ``spec`` under ``mem``; None when it has no published entry
    (source auto/published with a table) or cannot hold a 128-token micro-batch."""
    if spec.source not in SOURCES:
        raise ConfigError(f"system.sim.cost.source: unknown {spec.source!r} (one of: {', '.join(SOURCES)})")
    data = data or load_cost_data()
    table = data.published_table(model.name, hw.memory_bytes)
    if spec.source == "published" and table is None:
        raise ConfigError(f"system.sim.cost.source: no published coefficients for {model.name} on "
                          f"{data.memory_class(hw.memory_bytes)} GPUs (only llama-7b); use auto or derived")
    use_table = table is not None and spec.source != "derived"
    if use_table and (tp, pp) not in table:
        return None
    if pp > model.num_layers:
        return None
    cap = mem.cap(tp, pp)
    if cap < CAP_ROUND:
        return None
    util = data.util(tp, hw.memory_bytes)
    if use_table:
        a, b, c = table[(tp, pp)]
        return ReplicaCost(tp, pp, a, b, c, cap, util)
    c_ms = spec.c_per_layer_ms if spec.c_per_layer_ms >= 0 else published_c_per_layer_ms(data, memory_bytes=hw.memory_bytes)
    return ReplicaCost.from_seq_cost(tp, pp, derived_seq_cost(model, tp, pp, hw, spec.mfu, spec.causal, c_ms / 1e3),
                                     cap, util)


def strategy_costs(model, hw, mem: MemoryModel, spec: CostSpec, max_gpus: int,
                   data: Optional[CostData] = None) -> list[ReplicaCost]:
    """Every strategy (the published table's, or tp x pp over ``spec``'s degrees) that can hold
    at least one 128-token micro-batch, ordered by (gpus, tp)."""
    out = []
    for tp in spec.tp_degrees:
        for pp in spec.pp_degrees:
            if tp * pp > max_gpus:
                continue
            r = strategy_cost(model, hw, mem, spec, tp, pp, data)
            if r is not None:
                out.append(r)
    return sorted(out, key=lambda r: (r.gpus, r.tp))
