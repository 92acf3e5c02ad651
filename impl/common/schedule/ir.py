"""Schedule IR: a schedule is ``{stage: [Action, ...]}`` in execution order.

Text form of one action (round-trips through :func:`Action.parse`):
    ``F3``      forward of micro-batch 3
    ``B3``      input-gradient backward (ZB "B")
    ``W3``      weight-gradient backward (ZB "W")
    ``BW3``     full backward (B and W fused, as 1F1B/GPipe run it)
    ``SF3>2``   send forward activation of micro-batch 3 to stage 2
    ``RF3<0``   receive forward activation of micro-batch 3 from stage 0
    ``SB3>0``   send backward gradient of micro-batch 3 to stage 0
    ``RB3<2``   receive backward gradient of micro-batch 3 from stage 2
A schedule prints as one line per stage: ``0: F0 SF0>1 F1 ...``.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Optional


class Op(str, enum.Enum):
    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    SEND_F = "SF"
    RECV_F = "RF"
    SEND_B = "SB"
    RECV_B = "RB"

    @property
    def is_compute(self) -> bool:
        return self in (Op.F, Op.B, Op.W, Op.BW)

    @property
    def is_send(self) -> bool:
        return self in (Op.SEND_F, Op.SEND_B)

    @property
    def is_recv(self) -> bool:
        return self in (Op.RECV_F, Op.RECV_B)


_ACTION_RE = re.compile(r"^(BW|SF|RF|SB|RB|F|B|W)(\d+)(?:([<>])(\d+))?$")


@dataclass(frozen=True, order=True)
class Action:
    op: Op
    mb: int
    peer: Optional[int] = None

    def __post_init__(self) -> None:
        needs_peer = not self.op.is_compute
        if needs_peer and self.peer is None:
            raise ValueError(f"action {self.op.value}{self.mb}: communication needs a peer stage")
        if not needs_peer and self.peer is not None:
            raise ValueError(f"action {self.op.value}{self.mb}: compute takes no peer")
        if self.mb < 0:
            raise ValueError(f"action {self.op.value}{self.mb}: micro-batch id must be >= 0")

    def __str__(self) -> str:
        if self.peer is None:
            return f"{self.op.value}{self.mb}"
        arrow = ">" if self.op.is_send else "<"
        return f"{self.op.value}{self.mb}{arrow}{self.peer}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        m = _ACTION_RE.match(text.strip())
        if not m:
            raise ValueError(f"cannot parse schedule action {text!r} (expected e.g. F3, BW3, SF3>2, RB3<1)")
        op, mb, arrow, peer = m.groups()
        action_op = Op(op)
        if arrow is not None:
            expected = ">" if action_op.is_send else "<" if action_op.is_recv else None
            if arrow != expected:
                raise ValueError(f"schedule action {text!r}: wrong direction marker {arrow!r}")
        return cls(action_op, int(mb), None if peer is None else int(peer))


Schedule = dict[int, list[Action]]


def format_schedule(schedule: Schedule) -> str:
    return "\n".join(f"{s}: " + " ".join(str(a) for a in schedule[s]) for s in sorted(schedule))


def parse_schedule(text: str) -> Schedule:
    out: Schedule = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        head, sep, body = line.partition(":")
        if not sep or not head.strip().isdigit():
            raise ValueError(f"schedule line {lineno}: expected '<stage>: <actions>', got {line!r}")
        stage = int(head)
        if stage in out:
            raise ValueError(f"schedule line {lineno}: stage {stage} listed twice")
        out[stage] = [Action.parse(tok) for tok in body.split()]
    return out
