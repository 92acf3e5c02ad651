"""Add point-to-point communication to a compute-only schedule, and strip it again.

Placement (ADAPTRA paper, Alg. 3/4, arXiv 2504.19232: "RECV before the consumer, SEND after the producer"):
* SEND right after its producer: ``SF j>i+1`` after ``F j`` on stages < S−1, ``SB j>i−1``
  after ``B j``/``BW j`` on stages > 0;
* RECV right before its consumer: ``RF j<i−1`` before ``F j`` on stages > 0, ``RB j<i+1``
  before ``B j``/``BW j`` on stages < S−1.

Between two compute ops there is then at most one SEND and one RECV. When both talk to the
same neighbour, two adjacent ranks would both try to send first and an in-stream (blocking)
send deadlocks (PyTorch #172668). Rank parity breaks the tie: even stages send
first, odd stages receive first, which lines up the two ends as Megatron's 1F1B does. An odd
stage receives first only when that is causally safe, i.e. the neighbour produces the message
we receive before it consumes the one we send; otherwise the send stays first (receiving
first would wait on our own unsent message). With buffered sends (the harness' comm workers
and delegates) the result never deadlocks for any compute order the validator's dry run
accepts. With blocking (rendezvous) sends this placement is safe for GPipe and 1F1B but not
for every ZB/ADAPTRA order: two neighbours may disagree on which of their messages crosses
the link first while compute separates the two.

``blocking_sends=True`` repairs that: it replays the placement with rendezvous semantics and,
whenever two neighbours wait on each other, moves one SEND one action later (the one that
then meets the other's message at once; failing that, the odd stage's, as rank parity says),
until everything completes. Sends only move later, so placement stays legal, and the replay
is itself a witness that the result completes under rendezvous (and hence buffered) sends.
It changes nothing where the plain placement is already rendezvous-safe (e.g. 1F1B).
"""
from __future__ import annotations

from typing import Optional

from impl.common.api import ConfigError
from impl.common.schedule.ir import Action, Op, Schedule


_TWIN = {Op.SEND_F: Op.RECV_F, Op.RECV_F: Op.SEND_F, Op.SEND_B: Op.RECV_B, Op.RECV_B: Op.SEND_B}


def compute_only(schedule: Schedule) -> Schedule:
    """The same schedule without its SEND/RECV actions."""
    return {s: [a for a in actions if a.op.is_compute] for s, actions in schedule.items()}


def _comm_of(s: int, a: Action, S: int) -> tuple[Optional[Action], Optional[Action]]:
    """(RECV before, SEND after) compute action ``a`` on stage ``s``."""
    if a.op is Op.F:
        return (Action(Op.RECV_F, a.mb, s - 1) if s > 0 else None,
                Action(Op.SEND_F, a.mb, s + 1) if s + 1 < S else None)
    if a.op in (Op.B, Op.BW):
        return (Action(Op.RECV_B, a.mb, s + 1) if s + 1 < S else None,
                Action(Op.SEND_B, a.mb, s - 1) if s > 0 else None)
    return None, None


def insert_comm(compute_schedule: Schedule, *, blocking_sends: bool = False) -> Schedule:
    """Compute-only schedule -> the same compute order with SEND/RECV placed (see module doc).

    ``blocking_sends=True`` additionally makes the result safe for rendezvous sends (the
    runtime's inline/in-stream P2P); leave it off for buffered comm workers and delegates,
    where the plain placement sends as early as possible.
    """
    out = _place(compute_schedule)
    return _rendezvous_safe(out) if blocking_sends else out


def _place(compute_schedule: Schedule) -> Schedule:
    S = len(compute_schedule)
    if set(compute_schedule) != set(range(S)):
        raise ConfigError(f"schedule has stages {sorted(compute_schedule)}, expected 0..{S - 1}")
    for s, actions in compute_schedule.items():
        for a in actions:
            if not a.op.is_compute:
                raise ConfigError(f"insert_comm takes a compute-only schedule; stage {s} has {a} "
                                  "(strip it with compute_only first)")
    # position of each F / backward (B or BW) per stage, for the parity safety test
    pos = {s: {("F" if a.op is Op.F else "bwd", a.mb): k for k, a in enumerate(acts) if a.op is not Op.W}
           for s, acts in compute_schedule.items()}

    def receive_first_is_safe(send: Action, recv: Action) -> bool:
        # our message is consumed on the peer at pos[peer][send key]; the one we receive is
        # produced there at pos[peer][recv key]. Safe iff produced before ours is consumed.
        peer = send.peer
        consumed = pos[peer].get(("F" if send.op is Op.SEND_F else "bwd", send.mb))
        produced = pos[peer].get(("F" if recv.op is Op.RECV_F else "bwd", recv.mb))
        return consumed is not None and produced is not None and produced < consumed

    out: Schedule = {}
    for s in range(S):
        row: list[Action] = []
        pending_send: Optional[Action] = None
        for a in compute_schedule[s]:
            recv, send = _comm_of(s, a, S)
            run = [x for x in (pending_send, recv) if x is not None]
            if (len(run) == 2 and s % 2 == 1 and pending_send.peer == recv.peer
                    and receive_first_is_safe(pending_send, recv)):
                run.reverse()
            row += run
            row.append(a)
            pending_send = send
        if pending_send is not None:
            row.append(pending_send)
        out[s] = row
    return out


def _rendezvous_safe(rows: Schedule) -> Schedule:
    """Replay ``rows`` with rendezvous sends, delaying a SEND whenever neighbours wait on each other."""
    S = len(rows)
    items = {s: list(rows[s]) for s in range(S)}
    ptr = [0] * S
    runnable = list(range(S))

    def head(s: int) -> Optional[Action]:
        row = items[s]
        return row[ptr[s]] if ptr[s] < len(row) else None

    def matches(a: Action, s: int, b: Optional[Action]) -> bool:
        return b is not None and b.peer == s and b.mb == a.mb and b.op is _TWIN[a.op]

    def next_non_send(x: int) -> Optional[int]:
        row, k = items[x], ptr[x] + 1
        while k < len(row) and row[k].op.is_send:
            k += 1
        return k if k < len(row) else None

    while True:
        while runnable:  # advance every stage as far as rendezvous semantics allow
            s = runnable.pop()
            while (a := head(s)) is not None:
                if a.op.is_compute:
                    ptr[s] += 1
                    continue
                if not matches(a, s, head(a.peer)):
                    break
                ptr[s] += 1
                ptr[a.peer] += 1
                runnable.append(a.peer)
        if all(head(s) is None for s in range(S)):
            return items
        moved = set()
        for s in range(S):  # stuck: break every pair of neighbours waiting on each other
            a = head(s)
            if a is None or not a.op.is_send or s in moved:
                continue
            b = head(a.peer)
            if b is None or b.peer != s or a.peer in moved:
                continue
            if b.op.is_recv:
                yielder = s  # the peer waits for a different message from us: ours goes later
            else:
                fast = [x for x, y in ((s, a.peer), (a.peer, s))
                        if next_non_send(x) is not None and matches(head(y), y, items[x][next_non_send(x)])]
                yielder = fast[0] if len(fast) == 1 else (s if s % 2 else a.peer)
            # move the SEND just past the next action that is not a SEND: moving it past another
            # SEND only makes a new blocked head (two sends could swap back and forth forever)
            k, row = ptr[yielder], items[yielder]
            k2 = next_non_send(yielder)
            if k2 is None:
                raise ConfigError(f"insert_comm: stage {yielder} cannot delay {row[k]}: nothing follows it "
                                  "but sends")
            row.insert(k2, row.pop(k))
            moved.add(yielder)
            runnable.append(yielder)
        if not moved:
            stuck = ", ".join(f"stage {s} at {head(s)}" for s in range(S) if head(s) is not None)
            raise ConfigError(f"insert_comm: compute order deadlocks: {stuck}")

