"""Columnar form of a schedule: every stage's actions as three flat integer arrays.

A :class:`~impl.common.schedule.ir.Schedule` holds one ``Action`` object per op; at S=128
stages and N=1024 micro-batches that is 782k objects, and reading them back (op, mb, peer)
takes longer than simulating them. A :class:`ScheduleTable` holds the same actions as
numpy arrays, in the same order, so the compiled simulator (``impl.common.sim.compiled``)
reads it without touching a Python object per action. Convert once and simulate many times
(e.g. one schedule under many delay tables); the conversion is lossless both ways.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain, compress
from operator import attrgetter

import numpy as np

from impl.common.api import ConfigError
from impl.common.schedule.ir import Action, Op, Schedule

# Op codes of the table's ``op`` column: compute ops first, so ``op < 4`` is "compute".
OP_CODES: tuple[Op, ...] = (Op.F, Op.B, Op.W, Op.BW, Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B)
CODE_OF_VALUE = {op.value: code for code, op in enumerate(OP_CODES)}
F, B, W, BW, SEND_F, RECV_F, SEND_B, RECV_B = range(len(OP_CODES))
NO_PEER = -1

_op_value, _mb, _peer = attrgetter("op._value_"), attrgetter("mb"), attrgetter("peer")


@dataclass(frozen=True)
class ScheduleTable:
    """Stage ``s``'s actions are rows ``offsets[s]:offsets[s + 1]`` of ``op`` / ``mb`` / ``peer``
    (``peer`` is ``NO_PEER`` for compute ops). The arrays are read-only."""

    offsets: np.ndarray  # int64, S + 1
    op: np.ndarray  # int8 codes into OP_CODES
    mb: np.ndarray  # int64
    peer: np.ndarray  # int64

    def __post_init__(self) -> None:
        n = int(self.offsets[-1]) if len(self.offsets) else -1
        if len(self.offsets) < 2 or self.offsets[0] != 0 or np.any(np.diff(self.offsets) < 0):
            raise ConfigError("ScheduleTable.offsets must start at 0, be non-decreasing and name >= 1 stage")
        for name in ("op", "mb", "peer"):
            if len(getattr(self, name)) != n:
                raise ConfigError(f"ScheduleTable.{name} has {len(getattr(self, name))} rows, offsets say {n}")
        if n and (self.op.min() < 0 or self.op.max() >= len(OP_CODES)):
            raise ConfigError(f"ScheduleTable.op holds a code outside 0..{len(OP_CODES) - 1}")
        if n and self.mb.min() < 0:
            raise ConfigError("ScheduleTable.mb: micro-batch ids must be >= 0")
        is_comm = self.op >= SEND_F
        if np.any(self.peer[~is_comm] != NO_PEER) or np.any(self.peer[is_comm] < 0):
            raise ConfigError(f"ScheduleTable.peer must be {NO_PEER} for compute ops and a stage >= 0 for "
                              "SEND/RECV ops")
        for name in ("offsets", "op", "mb", "peer"):  # read-only views: the caller's arrays stay as they were
            view = np.asarray(getattr(self, name)).view()
            view.setflags(write=False)
            object.__setattr__(self, name, view)

    @property
    def num_stages(self) -> int:
        return len(self.offsets) - 1

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def row_length(self, stage: int) -> int:
        return int(self.offsets[stage + 1] - self.offsets[stage])

    def action(self, stage: int, index: int) -> Action:
        i = int(self.offsets[stage]) + index
        p = int(self.peer[i])
        return Action(OP_CODES[int(self.op[i])], int(self.mb[i]), None if p == NO_PEER else p)

    @classmethod
    def from_schedule(cls, schedule: Schedule) -> "ScheduleTable":
        """Stages must be 0..S-1 (the simulator's check); any valid ``Action`` lists convert."""
        S = len(schedule)
        if sorted(schedule) != list(range(S)):
            raise ConfigError(f"schedule has stages {sorted(schedule)}, expected 0..{S - 1}")
        rows = [schedule[s] for s in range(S)]
        offsets = np.zeros(S + 1, np.int64)
        np.cumsum([len(r) for r in rows], out=offsets[1:])
        n = int(offsets[-1])
        op = np.fromiter(map(CODE_OF_VALUE.__getitem__, map(_op_value, chain.from_iterable(rows))), np.int8, n)
        mb = np.fromiter(map(_mb, chain.from_iterable(rows)), np.int64, n)
        is_comm = op >= SEND_F  # only comm actions have a peer (Action checks that)
        peer = np.full(n, NO_PEER, np.int64)
        peer[is_comm] = np.fromiter(map(_peer, compress(chain.from_iterable(rows), is_comm.tolist())), np.int64,
                                    int(is_comm.sum()))
        return cls(offsets, op, mb, peer)

    def to_schedule(self) -> Schedule:
        ops = [OP_CODES[c] for c in self.op.tolist()]
        mbs, peers = self.mb.tolist(), self.peer.tolist()
        acts = [Action(o, m, None if p == NO_PEER else p) for o, m, p in zip(ops, mbs, peers)]
        off = self.offsets.tolist()
        return {s: acts[off[s]:off[s + 1]] for s in range(self.num_stages)}
