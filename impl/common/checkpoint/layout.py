"""Which rank holds which part of which tensor, and how a tensor is cut into S splits.

A :class:`TensorMeta` says a tensor's shape, dtype and *shard dim* (None: replicated, stored
whole as ``<name>_full``). A sharded tensor is cut into S equal splits along its shard dim;
a fused tensor (``fused`` = f pieces stacked on the shard dim, e.g. QKV = 3) is cut per piece,
split j being the j-th slice of every piece, so a TP rank's heads of q, k and v are one run of
splits. A :class:`CheckpointLayout` maps rank -> tensor name -> ``(t, g)``: the rank holds fraction
``[t/g, (t+1)/g)`` of the tensor along its shard dim (the convention of
:mod:`impl.common.parallel.migration` and the TP code), i.e. splits ``[t*S/g, (t+1)*S/g)``;
``(0, 1)`` is the whole tensor. Ranks of one DP group hold the same fractions.

Everything here is data and pure functions over it: a layout prints, compares, saves as
JSON, and a save or read plan is computed from it with no I/O.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

from impl.common.api import ConfigError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"checkpoint: dtype {dtype} is not supported (one of: {', '.join(DTYPES)})")
    return DTYPE_NAMES[dtype]


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str
    dim: Optional[int] = None  # shard dim; None = replicated (stored whole)
    fused: int = 1  # pieces stacked along dim (QKV = 3), each cut into S splits

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "dim": self.dim, "fused": self.fused}

    @classmethod
    def from_dict(cls, d: Mapping) -> "TensorMeta":
        return cls(d["name"], tuple(int(x) for x in d["shape"]), d["dtype"], d["dim"], int(d.get("fused", 1)))

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=DTYPES[self.dtype]).element_size()


Ownership = dict[str, tuple[int, int]]  # tensor name -> (t, g)


@dataclass
class CheckpointLayout:
    """rank -> tensor name -> (t, g). A rank missing a tensor does not hold it."""

    ranks: dict[int, Ownership]

    def to_dict(self) -> dict:
        return {str(r): {k: list(v) for k, v in own.items()} for r, own in sorted(self.ranks.items())}

    @classmethod
    def from_dict(cls, d: Mapping) -> "CheckpointLayout":
        return cls({int(r): {k: (int(v[0]), int(v[1])) for k, v in own.items()} for r, own in d.items()})

    def degrees(self) -> set[int]:
        return {g for own in self.ranks.values() for (_, g) in own.values()}


def check_meta(meta: TensorMeta, S: int) -> None:
    if meta.dim is None:
        return
    if not 0 <= meta.dim < len(meta.shape):
        raise ConfigError(f"checkpoint: tensor {meta.name} has shard dim {meta.dim} but shape {list(meta.shape)}")
    rows = meta.shape[meta.dim]
    if rows % (meta.fused * S):
        raise ConfigError(f"checkpoint.splits: S={S} x fused={meta.fused} does not divide dim {meta.dim} "
                          f"({rows} rows) of tensor {meta.name}")


def check_rank(metas: Sequence[TensorMeta], own: Ownership, rank: int, S: int) -> None:
    """One rank's fractions are whole numbers of splits of tensors that exist."""
    by_name = {m.name: m for m in metas}
    for name, (t, g) in own.items():
        if name not in by_name:
            raise ConfigError(f"layout: rank {rank} holds unknown tensor {name}")
        m = by_name[name]
        if S % g:
            raise ConfigError(f"checkpoint.splits: S={S} is not divisible by TP degree {g} "
                              f"(rank {rank}, tensor {name})")
        check_meta(m, S)
        if m.dim is None and (t, g) != (0, 1):
            raise ConfigError(f"layout: rank {rank} holds part {t}/{g} of replicated tensor {name}")
        if g < 1 or not 0 <= t < g:
            raise ConfigError(f"layout: rank {rank} holds part {t} of {g} of {name}")


def check_layout(metas: Sequence[TensorMeta], layout: CheckpointLayout, S: int) -> None:
    """Every fraction is a whole number of splits, every tensor is fully covered."""
    for r, own in sorted(layout.ranks.items()):
        check_rank(metas, own, r, S)
    for m in metas:
        check_meta(m, S)
    for m in metas:
        covered = set()
        for own in layout.ranks.values():
            if m.name in own:
                covered |= set(split_range(own[m.name], S, m))
        need = set(range(S)) if m.dim is not None else {None}
        if covered != need:
            missing = sorted(need - covered, key=str)
            raise ConfigError(f"layout: tensor {m.name} is not fully held (missing splits {missing[:8]})")


def split_range(tg: tuple[int, int], S: int, meta: TensorMeta) -> list:
    """The split indices of fraction (t, g); ``[None]`` for a replicated tensor."""
    if meta.dim is None:
        return [None]
    t, g = tg
    k = S // g
    return list(range(t * k, (t + 1) * k))


# ---- cutting tensors ------------------------------------------------------------------

def _pieces(x: torch.Tensor, meta: TensorMeta, parts: int) -> torch.Tensor:
    """View of x with the shard dim unflattened to (fused, parts, rows per part)."""
    d = meta.dim
    n = x.shape[d]
    return x.unflatten(d, (meta.fused, parts, n // meta.fused // parts))


def cut(full: torch.Tensor, meta: TensorMeta, t: int, g: int) -> torch.Tensor:
    """Fraction (t, g) of a whole tensor (a copy)."""
    if meta.dim is None:
        return full.clone()
    v = _pieces(full, meta, g).select(meta.dim + 1, t)
    # clone, not contiguous(): a row block is already contiguous and would stay a view
    return v.flatten(meta.dim, meta.dim + 1).clone(memory_format=torch.contiguous_format)


def join(parts: Sequence[torch.Tensor], meta: TensorMeta) -> torch.Tensor:
    """Inverse of :func:`cut` over t = 0..len(parts)-1 (also joins splits into a fraction)."""
    if meta.dim is None:
        return parts[0].clone()
    d = meta.dim
    views = [p.unflatten(d, (meta.fused, p.shape[d] // meta.fused)) for p in parts]
    return torch.stack(views, dim=d + 1).flatten(d, d + 2).contiguous()


def local_splits(local: torch.Tensor, meta: TensorMeta, tg: tuple[int, int], S: int) -> dict:
    """Split index -> contiguous tensor, for a rank's fraction ``local`` = (t, g)."""
    if meta.dim is None:
        return {None: local.contiguous()}
    idx = split_range(tg, S, meta)
    v = _pieces(local, meta, len(idx))
    d = meta.dim
    return {j: v.select(d + 1, i).flatten(d, d + 1).contiguous() for i, j in enumerate(idx)}


def cut_state(full: Mapping[str, torch.Tensor], metas: Sequence[TensorMeta], own: Ownership) -> dict[str, torch.Tensor]:
    """A rank's local state under ownership ``own``."""
    by = {m.name: m for m in metas}
    return {k: cut(full[k], by[k], *tg) for k, tg in own.items()}


def gather_state(locals_by_rank: Mapping[int, Mapping[str, torch.Tensor]], metas: Sequence[TensorMeta],
                 layout: CheckpointLayout) -> dict[str, torch.Tensor]:
    """Whole tensors back from every rank's local state (a test and report helper)."""
    out = {}
    for m in metas:
        by_t: dict[int, torch.Tensor] = {}
        g_seen = None
        for r in sorted(layout.ranks):
            if m.name in layout.ranks[r]:
                t, g = layout.ranks[r][m.name]
                g_seen = g
                by_t.setdefault(t, locals_by_rank[r][m.name])
        out[m.name] = join([by_t[t] for t in range(g_seen)], m)
    return out


# ---- model layouts ----------------------------------------------------------------------

_BLOCK = re.compile(r"(?:^|\.|/)blocks\.(\d+)\.")


def tensor_layer(name: str, num_layers: int) -> int:
    """Pipeline position of a state tensor: its block, -1 for the embedding, L for the rest
    (final norm, LM head)."""
    m = _BLOCK.search(name)
    if m:
        return int(m.group(1))
    return -1 if "emb" in name else num_layers


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: its TP group's ranks and its layers [lo, hi)."""

    ranks: tuple[int, ...]
    layers: tuple[int, int]


def pipeline_layout(metas: Sequence[TensorMeta], pipelines: Sequence[Sequence[StagePlan]], num_layers: int) -> CheckpointLayout:
    """The layout of DP replicas of (possibly heterogeneous) pipelines: each stage holds its
    layers' tensors (plus the embedding on the first stage and the head on the last), TP rank
    i of a stage of g ranks holds fraction (i, g) of each sharded tensor, whole replicated ones."""
    ranks: dict[int, Ownership] = {}
    for stages in pipelines:
        for si, st in enumerate(stages):
            lo, hi = st.layers
            for m in metas:
                pos = tensor_layer(m.name, num_layers)
                mine = lo <= pos < hi or (pos == -1 and si == 0) or (pos == num_layers and si == len(stages) - 1)
                if not mine:
                    continue
                g = len(st.ranks)
                for i, r in enumerate(st.ranks):
                    ranks.setdefault(r, {})[m.name] = (0, 1) if m.dim is None else (i, g)
            for r in st.ranks:
                ranks.setdefault(r, {})
    return CheckpointLayout(ranks)


def format_layout(pipelines: Sequence[Sequence[StagePlan]]) -> str:
    """``[TP2 L0-2 | TP1 L2-4]`` per pipeline."""
    return " ; ".join("[" + " | ".join(f"TP{len(s.ranks)} L{s.layers[0]}-{s.layers[1]} r{','.join(map(str, s.ranks))}"
                                       for s in p) + "]" for p in pipelines)
