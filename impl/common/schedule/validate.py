"""Static and dry-run checks of a schedule, so a bad one fails here with one clear line
instead of hanging a multi-process run or silently skewing a simulation.

Accepts compute-only schedules (F/B/W/BW, as generators and the ADAPTRA builder emit them)
and full ones with SEND/RECV actions (as :func:`impl.common.schedule.comm.insert_comm`
emits them). A schedule with any communication action must carry all of it.

Checks, in this order (the first failure is raised):
stage set -> peers adjacent and in the right direction -> micro-batch range and duplicates ->
backward form (B+W or BW, not both) -> missing compute ops -> F before B/BW, B before W ->
send/recv pairing -> missing or misplaced comm -> per-link order -> in-flight activations vs
quota/limit -> deadlock (dry run).

The dry run advances any stage whose next action's dependencies are met. By default sends
are buffered (a SEND never blocks: the harness' comm workers and delegates queue them);
``blocking_sends=True`` makes each SEND wait for its RECV (rendezvous, like an in-stream NCCL
send), the strictest runtime model.
"""
from __future__ import annotations

from collections import defaultdict, deque
from typing import Optional, Sequence

from impl.common.api import ConfigError
from impl.common.schedule.ir import Schedule


class ScheduleError(ConfigError):
    """A schedule breaks an invariant. One line: stage, action, what is wrong."""


# Actions are handled as plain (code, mb, peer) tuples here: hashing the Op enum and building
# frozen dataclasses dominated the run time on 128-stage, 1024-micro-batch schedules.
_PEER_OFFSET = {"SF": 1, "RF": -1, "SB": -1, "RB": 1}
_MATCH = {"SF": "RF", "SB": "RB", "RF": "SF", "RB": "SB"}
_SENDS = ("SF", "SB")

Key = tuple  # (code, mb, peer)


def _txt(k: Key) -> str:
    code, mb, peer = k
    if peer is None:
        return f"{code}{mb}"
    return f"{code}{mb}{'>' if code in _SENDS else '<'}{peer}"


def _keys(schedule: Schedule, S: int) -> dict[int, list[Key]]:
    return {s: [(a.op._value_, a.mb, a.peer) for a in schedule[s]] for s in range(S)}


def peak_inflight(schedule: Schedule) -> dict[int, int]:
    """Per stage, the most forwards done whose B/BW is not yet done (stored activations)."""
    out = {}
    for s, actions in schedule.items():
        cur = peak = 0
        for a in actions:
            code = a.op._value_
            if code == "F":
                cur += 1
                peak = max(peak, cur)
            elif code == "B" or code == "BW":
                cur -= 1
        out[s] = peak
    return out


def _fail(msg: str) -> None:
    raise ScheduleError(msg)


def _check_stages(schedule: Schedule, S: int, N: int) -> None:
    if S < 1:
        _fail(f"num_stages must be >= 1, got {S}")
    if N < 1:
        _fail(f"num_microbatches must be >= 1, got {N}")
    if set(schedule) != set(range(S)):
        _fail(f"schedule has stages {sorted(schedule)}, expected 0..{S - 1} (num_stages {S})")


def _index(keys: dict[int, list[Key]], S: int, N: int) -> dict[int, dict[Key, int]]:
    """Position of each action per stage; checks peers, micro-batch range and duplicates."""
    pos: dict[int, dict[Key, int]] = {}
    for s in range(S):
        where: dict[Key, int] = {}
        for k, key in enumerate(keys[s]):
            code, mb, peer = key
            if mb >= N:
                _fail(f"stage {s} action {_txt(key)} (position {k}): micro-batch {mb} out of range for "
                      f"num_microbatches {N}")
            if peer is not None:
                if abs(peer - s) != 1:
                    what = "sends only to" if code in _SENDS else "receives only from"
                    _fail(f"stage {s} action {_txt(key)}: {what} adjacent stages, {peer} is not adjacent to {s}")
                if not 0 <= peer < S:
                    _fail(f"stage {s} action {_txt(key)}: no stage {peer} (num_stages {S})")
                want = s + _PEER_OFFSET[code]
                if peer != want:
                    _fail(f"stage {s} action {_txt(key)}: {code} must name stage {want}, not {peer}")
            if key in where:
                _fail(f"stage {s} action {_txt(key)} appears twice (positions {where[key]} and {k})")
            where[key] = k
        pos[s] = where
    return pos


def _backward_form(keys: dict[int, list[Key]], split_backward: Optional[bool]) -> bool:
    codes = {k[0] for row in keys.values() for k in row}
    split, fused = bool(codes & {"B", "W"}), "BW" in codes
    if split and fused:
        _fail("schedule mixes split backward (B/W) and fused backward (BW)")
    if split_backward is not None and fused and split_backward:
        _fail("split_backward=True but the schedule uses fused BW actions")
    if split_backward is not None and split and not split_backward:
        _fail("split_backward=False but the schedule uses split B/W actions")
    return split if split_backward is None else split_backward


def _check_compute(pos, S: int, N: int, split: bool) -> None:
    bwd = "B" if split else "BW"
    for s in range(S):
        p = pos[s]
        for j in range(N):
            f, b = ("F", j, None), (bwd, j, None)
            for key in (f, b, ("W", j, None)) if split else (f, b):
                if key not in p:
                    _fail(f"stage {s} is missing {_txt(key)} (every stage runs each compute op once per "
                          "micro-batch)")
            if p[f] > p[b]:
                _fail(f"stage {s} action {bwd}{j} (position {p[b]}) runs before F{j} (position {p[f]})")
            if split and p[b] > p[("W", j, None)]:
                _fail(f"stage {s} action W{j} (position {p[('W', j, None)]}) runs before B{j} "
                      f"(position {p[b]})")


def _check_comm(keys, pos, S: int, N: int, split: bool) -> None:
    for s in range(S):
        for key in keys[s]:
            code, mb, peer = key
            if peer is None:
                continue
            twin = (_MATCH[code], mb, s)
            if twin not in pos[peer]:
                kind = "send" if code in _SENDS else "receive"
                _fail(f"stage {s} action {_txt(key)}: unmatched {kind}, no {_txt(twin)} on stage {peer}")
    bwd = "B" if split else "BW"
    for s in range(S):
        p = pos[s]
        row = keys[s]
        for j in range(N):
            f, b = p[("F", j, None)], p[(bwd, j, None)]
            around = []  # (comm key, compute position, must come after it?)
            if s + 1 < S:
                around += [(("SF", j, s + 1), f, True), (("RB", j, s + 1), b, False)]
            if s > 0:
                around += [(("RF", j, s - 1), f, False), (("SB", j, s - 1), b, True)]
            for comm, at, after in around:
                where = p.get(comm)
                if where is None:
                    _fail(f"stage {s} is missing {_txt(comm)} ({'after' if after else 'before'} "
                          f"{_txt(row[at])})")
                if (where > at) != after:
                    _fail(f"stage {s} action {_txt(comm)} (position {where}) must come "
                          f"{'after' if after else 'before'} {_txt(row[at])} (position {at})")


def _check_link_order(keys, S: int) -> None:
    for s in range(S):
        for send in _SENDS:
            peer = s + _PEER_OFFSET[send]
            if not 0 <= peer < S:
                continue
            recv = _MATCH[send]
            sent = [k[1] for k in keys[s] if k[0] == send]
            got = [k[1] for k in keys[peer] if k[0] == recv]
            if sent != got:
                k = next(i for i, (x, y) in enumerate(zip(sent, got)) if x != y)
                _fail(f"link {s}->{peer}: send order differs from receive order at message {k}: "
                      f"stage {s} sends {send}{sent[k]} but stage {peer} receives {recv}{got[k]}")


def _check_memory(keys, S: int, N: int, limit: Optional[Sequence[int]], what: str) -> None:
    if limit is None:
        return
    if len(limit) != S:
        _fail(f"{what} has {len(limit)} entries, expected num_stages {S}")
    if what == "warm-up quota":
        for s, x in enumerate(limit):
            if x > N:
                _fail(f"warm-up quota {x} on stage {s} exceeds num_microbatches {N}")
    for s in range(S):
        cur = 0
        for k, key in enumerate(keys[s]):
            if key[0] == "F":
                cur += 1
                if cur > limit[s]:
                    _fail(f"stage {s} action {_txt(key)} (position {k}): {cur} activations in flight "
                          f"exceeds {what} {limit[s]}")
            elif key[0] == "B" or key[0] == "BW":
                cur -= 1


def _events(s: int, key: Key, S: int, has_comm: bool):
    """(event this action waits for or None, event it produces or None)."""
    code, mb, peer = key
    if has_comm:
        if code == "RF" or code == "RB":
            return ("msg", peer, s, code[1], mb), None
        if code == "SF" or code == "SB":
            return None, ("msg", s, peer, code[1], mb)
        return None, None
    if code == "F":
        return (("F", s - 1, mb) if s > 0 else None), ("F", s, mb)
    if code == "B" or code == "BW":
        return (("bwd", s + 1, mb) if s + 1 < S else None), ("bwd", s, mb)
    return None, None  # W: same-stage order was checked statically


def _dry_run(keys, S: int, has_comm: bool, blocking_sends: bool) -> None:
    ptr = [0] * S
    done: set = set()
    waiters: dict = defaultdict(list)  # event -> stages blocked on it
    runnable = deque(range(S))

    def fire(event) -> None:
        done.add(event)
        runnable.extend(waiters.pop(event, ()))

    while runnable:
        s = runnable.popleft()
        row = keys[s]
        while ptr[s] < len(row):
            key = row[ptr[s]]
            need, made = _events(s, key, S, has_comm)
            if blocking_sends and made is not None and made[0] == "msg" and made not in done:
                # rendezvous: a SEND completes only together with its RECV
                if key[2] in waiters.get(made, ()):
                    fire(made)
                else:
                    waiters[("ack",) + made].append(s)
                    break
            if need is not None and need not in done:
                if blocking_sends and ("ack",) + need in waiters:
                    fire(("ack",) + need)  # the sender is blocked at its SEND: meet it
                    fire(need)
                else:
                    waiters[need].append(s)
                    break
            if made is not None and made not in done:
                fire(made)
            ptr[s] += 1
    stuck = [s for s in range(S) if ptr[s] < len(keys[s])]
    if stuck:
        parts = [f"stage {s} waits at {_txt(keys[s][ptr[s]])} (position {ptr[s]})" for s in stuck[:4]]
        more = f" and {len(stuck) - 4} more" if len(stuck) > 4 else ""
        mode = "blocking" if blocking_sends else "buffered"
        _fail(f"deadlock ({mode} sends): no stage can advance; " + ", ".join(parts) + more)


def validate_schedule(schedule: Schedule, num_stages: int, num_microbatches: int, *,
                      split_backward: Optional[bool] = None,
                      warmup_quota: Optional[Sequence[int]] = None,
                      memory_limit: Optional[Sequence[int]] = None,
                      blocking_sends: bool = False) -> None:
    """Raise :class:`ScheduleError` at the first broken invariant; return None if all hold.

    ``split_backward``: require B+W (True) or BW (False); None accepts either, consistently.
    ``warmup_quota`` / ``memory_limit``: per-stage caps on in-flight activations.
    """
    S, N = num_stages, num_microbatches
    _check_stages(schedule, S, N)
    keys = _keys(schedule, S)
    pos = _index(keys, S, N)
    split = _backward_form(keys, split_backward)
    _check_compute(pos, S, N, split)
    has_comm = any(k[2] is not None for row in keys.values() for k in row)
    if has_comm:
        _check_comm(keys, pos, S, N, split)
        _check_link_order(keys, S)
    _check_memory(keys, S, N, warmup_quota, "warm-up quota")
    _check_memory(keys, S, N, memory_limit, "memory limit")
    _dry_run(keys, S, has_comm, blocking_sends)
