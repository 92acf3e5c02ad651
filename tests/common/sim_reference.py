"""REFERENCE ONLY (tests): the pipeline simulator as it was before the issue-26 speed-up
(commit 67dba28, impl/common/sim/pipeline.py: a tuple per action, heap engine resumptions).
tests/common/test_sim_fast_equal.py checks the fast simulator against it, bit for bit.
Its CommModel is its own class; pass the same kind/fields to both.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Optional, Sequence, Union

from impl.common.api import ConfigError
from impl.common.cost.comm import LinkCosts
from impl.common.cost.transformer import StageCosts
from impl.common.schedule.ir import Action, Op, Schedule

from impl.common.sim.delays import normalize_delays
from impl.common.sim.events import EventLoop

COMM_KINDS = ("latency", "in_stream", "delegated", "blocking")
# A time-varying delay: (link index i of link (i, i+1), absolute time in s) -> seconds.
DelayFn = Callable[[int, float], float]
Delays = Union[Mapping, DelayFn, None]


@dataclass(frozen=True)
class CommModel:
    kind: str = "in_stream"
    # in_stream: messages a worker may hold (queued + in flight) before SEND blocks; None = unbounded.
    queue_depth: Optional[int] = 1
    # delegated: K delegate workers per (stage, direction).
    delegates: int = 3
    # delegated: CPU transfer is this much slower than GPU-direct RDMA ([R] 1.1-1.2x,
    # impl/adaptra/README.md).
    cpu_penalty: float = 1.15
    # Post each run of consecutive SEND/RECV actions (between two compute ops) as one batch,
    # sends first, as Megatron's batch_isend_irecv does (batch_p2p_comm, on by default). The
    # rank-parity order insert_comm writes exists for blocking rendezvous sends; with eager
    # sends, keeping it literally would hold a send behind a receive (one extra link delay
    # per round trip). False = run the actions strictly in schedule order.
    batch_p2p: bool = True

    def __post_init__(self) -> None:
        if self.kind not in COMM_KINDS:
            raise ConfigError(f"CommModel.kind must be one of {', '.join(COMM_KINDS)}, got {self.kind!r}")
        if self.queue_depth is not None and self.queue_depth < 1:
            raise ConfigError(f"CommModel.queue_depth must be >= 1 or None (unbounded), got {self.queue_depth}")
        if self.delegates < 1:
            raise ConfigError(f"CommModel.delegates must be >= 1, got {self.delegates}")
        if not self.cpu_penalty > 0:
            raise ConfigError(f"CommModel.cpu_penalty must be > 0, got {self.cpu_penalty}")


@dataclass(frozen=True)
class StageBreakdown:
    """Where a stage's share of the iteration went; the fields sum to the iteration time."""

    compute_s: float
    copy_s: float  # D2H/H2D copies on the stream (delegated path)
    startup_s: float  # waiting on RECV before the stage's first compute op
    dependency_s: float  # waiting on RECV after that: dependency bubbles
    hol_s: float  # SEND blocked on a full queue: head-of-line blocking
    dp_allreduce_s: float  # gradient all-reduce exposed after the stream finished
    tail_s: float  # done, waiting for the slowest stage

    @property
    def bubble_s(self) -> float:
        return self.startup_s + self.dependency_s + self.hol_s + self.copy_s + self.dp_allreduce_s + self.tail_s


class OpSpan(NamedTuple):
    stage: int
    index: int  # position in the stage's action list
    action: Action
    start_s: float  # stream reaches the action
    end_s: float  # stream moves on (a RECV: data usable; a SEND: message handed over)


class Message(NamedTuple):
    src: int
    dst: int
    forward: bool
    mb: int


@dataclass
class SimResult:
    iteration_time_s: float
    busy_s: tuple[float, ...]  # compute per stage
    breakdown: tuple[StageBreakdown, ...]
    schedule: Schedule
    comm_model: CommModel
    start_s: list[list[float]]  # [stage][action index]
    end_s: list[list[float]]
    # Per message id (dense ids, see _decode_key; ids no action used hold arrival None).
    tx_start_s: list[float]  # the worker/delegate starts sending
    arrival_s: list[Optional[float]]  # data at the receiver (before any H2D copy)
    n_links: int

    def bubble_fraction(self, stage: Optional[int] = None) -> float:
        """1 - busy/iteration time, for one stage or averaged over stages."""
        t = self.iteration_time_s
        if stage is not None:
            return (t - self.busy_s[stage]) / t
        return sum((t - b) / t for b in self.busy_s) / len(self.busy_s)

    def timeline(self) -> list[OpSpan]:
        return [OpSpan(s, k, a, self.start_s[s][k], self.end_s[s][k])
                for s in sorted(self.schedule) for k, a in enumerate(self.schedule[s])]

    def messages(self) -> list[tuple[int, Message]]:
        """(id, message) of every message sent in this iteration, in id order."""
        return [(m, _decode_key(m, self.n_links)) for m, arr in enumerate(self.arrival_s) if arr is not None]

    def _worker_label(self, msg: Message) -> str:
        kind = "fwd" if msg.forward else "bwd"
        if self.comm_model.kind == "delegated":
            return f"delegate {kind} {msg.mb % self.comm_model.delegates}"
        return f"send {kind} >{msg.dst}"

    def to_chrome_trace(self) -> dict:
        """Chrome trace-event JSON: pid = stage; tid 0 = compute stream (one event per action),
        further tids = comm workers (one event per message: its time on the wire)."""
        us = 1e6
        events: list[dict] = []
        for s in sorted(self.schedule):
            events.append({"ph": "M", "name": "process_name", "pid": s, "tid": 0, "args": {"name": f"stage {s}"}})
            events.append({"ph": "M", "name": "thread_name", "pid": s, "tid": 0, "args": {"name": "compute"}})
            for k, a in enumerate(self.schedule[s]):
                st, en = self.start_s[s][k], self.end_s[s][k]
                events.append({"ph": "X", "cat": "op", "name": str(a), "pid": s, "tid": 0,
                               "ts": st * us, "dur": (en - st) * us})
        tids: dict[tuple[int, str], int] = {}
        for m, msg in self.messages():
            label = self._worker_label(msg)
            tid = tids.get((msg.src, label))
            if tid is None:
                tid = tids[(msg.src, label)] = 1 + sum(1 for key in tids if key[0] == msg.src)
                events.append({"ph": "M", "name": "thread_name", "pid": msg.src, "tid": tid, "args": {"name": label}})
            events.append({"ph": "X", "cat": "comm", "name": f"{'F' if msg.forward else 'B'}{msg.mb} {msg.src}->{msg.dst}",
                           "pid": msg.src, "tid": tid, "ts": self.tx_start_s[m] * us,
                           "dur": (self.arrival_s[m] - self.tx_start_s[m]) * us})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_chrome_trace(self, path) -> None:
        with open(path, "w") as fh:
            json.dump(self.to_chrome_trace(), fh)


# Program codes of the compiled schedule (small ints keep the inner loop cheap).
_COMPUTE, _SEND_LAT, _SEND_Q, _SEND_DEL, _SEND_BLK, _RECV, _RECV_H2D = range(7)


@dataclass
class _Program:
    # [stage] -> [(code, a, b, c, k)] in execution order, k = index in the schedule's list:
    # compute (a = dur_s), send (a = msg, b = worker, c = cost_s), recv (a = msg)
    progs: list
    busy_s: list  # [stage] compute seconds
    first_compute: list  # [stage] schedule index of the first compute action (len if none)
    last_weight: list  # [stage] index of the last W/BW (else last compute; -1 if none)
    n_keys: int  # message ids are dense keys (see _decode_key); unused keys stay None
    n_workers: int


def _decode_key(m: int, n_links: int) -> Message:
    """Message ids are pre-indexed as ``(mb·n_links + link)·2 + forward`` (no lookup table)."""
    forward = bool(m & 1)
    mb, link = divmod(m >> 1, n_links)
    return Message(link, link + 1, True, mb) if forward else Message(link + 1, link, False, mb)


def _compile(schedule: Schedule, costs: StageCosts, link: LinkCosts, comm: CommModel,
             link_cost_s: list[float]) -> _Program:
    """Turn actions into (code, a, b, c, k) tuples; check every message is sent and received once.

    Ops are looked up by their string value: hashing the str-Enum itself runs Python code,
    and this loop sees every action (800k for S=128, N=1024).
    """
    S = costs.num_stages
    if sorted(schedule) != list(range(S)):
        raise ConfigError(f"schedule stages {sorted(schedule)} do not match the {S} stages of the costs")
    if len(link.p2p_s) != S - 1:
        raise ConfigError(f"LinkCosts.p2p_s has {len(link.p2p_s)} links, pipeline of {S} stages needs {S - 1}")
    L = max(S - 1, 1)
    n_keys = 2 * L * 64  # grown on demand
    sent, received = bytearray(n_keys), bytearray(n_keys)
    K = comm.delegates
    delegated = comm.kind == "delegated"
    send_code = {"latency": _SEND_LAT, "in_stream": _SEND_Q, "delegated": _SEND_DEL, "blocking": _SEND_BLK}[comm.kind]
    recv_code = _RECV_H2D if delegated else _RECV
    batch = comm.batch_p2p
    progs, busy, first_compute, last_weight = [], [], [], []
    for s in range(S):
        tf, tb, tw = costs.tf_s[s], costs.tb_s[s], costs.tw_s[s]
        dur = {"F": tf, "B": tb, "W": tw, "BW": tb + tw}
        # op -> (is_send, forward message, link index, the only legal peer)
        comm_of = {"SF": (True, 1, s, s + 1), "RB": (False, 0, s, s + 1),
                   "RF": (False, 1, s - 1, s - 1), "SB": (True, 0, s - 1, s - 1)}
        prog: list = []
        append = prog.append
        held: list = []  # receives of the current comm batch, posted after its sends
        total = 0.0
        first, last_w, last_c = -1, -1, -1
        for k, act in enumerate(schedule[s]):
            v = act.op._value_
            d = dur.get(v)
            if d is not None:
                if held:
                    prog += held
                    held = []
                append((_COMPUTE, d, 0, 0.0, k))
                total += d
                last_c = k
                if first < 0:
                    first = k
                if v == "W" or v == "BW":
                    last_w = k
                continue
            is_send, fwd, lk, peer = comm_of[v]
            if act.peer != peer or not 0 <= lk < S - 1:
                raise ConfigError(f"stage {s} action {k} ({act}): its peer must be the "
                                  f"{'next' if peer > s else 'previous'} stage {peer}, within 0..{S - 1}")
            mb = act.mb
            m = (mb * L + lk) * 2 + fwd  # see _decode_key
            if m >= n_keys:
                grow = max(n_keys, m + 1 - n_keys)
                sent.extend(bytes(grow))
                received.extend(bytes(grow))
                n_keys += grow
            if is_send:
                if sent[m]:
                    raise ConfigError(f"stage {s} action {k} ({act}): message sent twice")
                sent[m] = 1
                w = s * 2 + fwd
                append((send_code, m, w * K + mb % K if delegated else w, link_cost_s[lk], k))
            else:
                if received[m]:
                    raise ConfigError(f"stage {s} action {k} ({act}): message received twice")
                received[m] = 1
                if batch:
                    held.append((recv_code, m, 0, 0.0, k))
                else:
                    append((recv_code, m, 0, 0.0, k))
        prog += held
        progs.append(prog)
        busy.append(total)
        first_compute.append(first if first >= 0 else len(prog))
        last_weight.append(last_w if last_w >= 0 else last_c)
    if sent != received:
        m = next(i for i in range(n_keys) if sent[i] != received[i])
        msg = _decode_key(m, L)
        what = "received but never sent" if received[m] else "sent but never received"
        raise ConfigError(f"message {'F' if msg.forward else 'B'}{msg.mb} {msg.src}->{msg.dst} is {what}")
    return _Program(progs, busy, first_compute, last_weight, n_keys, 2 * S * (K if delegated else 1))


def _per_stage(value, S: int, name: str) -> list[float]:
    if value is None:
        return [0.0] * S
    if isinstance(value, (int, float)):
        vals = [float(value)] * S
    else:
        vals = [float(v) for v in value]
    if len(vals) != S or any(not v >= 0 for v in vals):
        raise ConfigError(f"{name} must be one value >= 0 or {S} values >= 0 (one per stage), got {value!r}")
    return vals


def simulate_iteration(schedule: Schedule, costs: StageCosts, link: LinkCosts, comm_model: CommModel, *,
                       delays: Delays = None, dp_allreduce_s=None, origin_s: float = 0.0) -> SimResult:
    """Simulate one iteration starting at time 0.

    ``delays``: ``{(i, i+1): seconds}`` per message, or a function ``(i, t_abs_s) -> seconds``
    evaluated when a message starts sending (t_abs_s = origin_s + local time), for delays that
    change within an iteration. ``dp_allreduce_s`` (one value or one per stage): gradient
    all-reduce started when the stage's last W (or BW) ends; the stage is done when both its
    stream and the all-reduce are.
    """
    S = costs.num_stages
    delay_fn: Optional[DelayFn] = delays if callable(delays) else None
    table = {} if delay_fn is not None else normalize_delays(delays, S)
    dp = _per_stage(dp_allreduce_s, S, "dp_allreduce_s")
    penalty = comm_model.cpu_penalty if comm_model.kind == "delegated" else 1.0
    base_s = [p * penalty for p in link.p2p_s]
    link_cost_s = [b + table.get((i, i + 1), 0.0) for i, b in enumerate(base_s)]
    prog = _compile(schedule, costs, link, comm_model, link_cost_s)
    progs = prog.progs
    L = max(S - 1, 1)

    Q = comm_model.queue_depth if comm_model.queue_depth is not None else sys.maxsize
    copy_s = link.copy_s if comm_model.kind == "delegated" else 0.0
    arrival: list = [None] * prog.n_keys
    tx_start = [0.0] * prog.n_keys
    waiter = [-1] * prog.n_keys
    wfree = [0.0] * prog.n_workers  # when each worker/delegate finishes its last message
    wdone: list[list[float]] = [[] for _ in range(prog.n_workers)]  # in_stream: delivery times
    starts = [[0.0] * len(p) for p in progs]
    ends = [[0.0] * len(p) for p in progs]
    pc = [0] * S
    clock = [0.0] * S
    wait_s = [0.0] * S
    hol_s = [0.0] * S
    eng = EventLoop()
    schedule_event = eng.schedule

    def run_stage(s: int) -> None:
        """Advance stage ``s`` until it needs a message nobody has produced yet."""
        prog_s, st, en = progs[s], starts[s], ends[s]
        n = len(prog_s)
        t = clock[s]
        wait, hol = wait_s[s], hol_s[s]
        k = n
        for i in range(pc[s], n):
            code, a, b, c, x = prog_s[i]
            st[x] = t
            if code == _COMPUTE:
                t += a
            elif code >= _RECV:
                arr = arrival[a]
                if arr is None:  # sleep until the producer sends it
                    waiter[a] = s
                    k = i
                    break
                if arr > t:
                    wait += arr - t
                    t = arr
                if code == _RECV_H2D:
                    t += copy_s
            else:
                if code == _SEND_Q:
                    done = wdone[b]
                    if len(done) >= Q and done[-Q] > t:  # worker full: head-of-line block
                        hol += done[-Q] - t
                        t = done[-Q]
                    tx0 = t if t > wfree[b] else wfree[b]
                elif code == _SEND_DEL:
                    t += copy_s  # D2H into the pinned slot before the delegate can see it
                    tx0 = t if t > wfree[b] else wfree[b]
                elif code == _SEND_BLK:
                    tx0 = t if t > wfree[b] else wfree[b]
                else:
                    tx0 = t
                if delay_fn is not None:
                    lk = (a >> 1) % L
                    c = base_s[lk] + delay_fn(lk, origin_s + tx0)
                tx1 = tx0 + c
                if code != _SEND_LAT:
                    wfree[b] = tx1
                    if code == _SEND_Q:
                        wdone[b].append(tx1)
                if code == _SEND_BLK:  # the stream itself sleeps the delay and sends
                    hol += tx1 - t
                    t = tx1
                tx_start[a] = tx0
                arrival[a] = tx1
                w = waiter[a]
                if w >= 0:
                    waiter[a] = -1
                    schedule_event(tx1, run_stage, w)
            en[x] = t
        pc[s], clock[s] = k, t
        wait_s[s], hol_s[s] = wait, hol

    for s in range(S):
        schedule_event(0.0, run_stage, s)
    eng.run()

    stuck = [s for s in range(S) if pc[s] < len(progs[s])]
    if stuck:
        at = {s: progs[s][pc[s]][4] for s in stuck}
        desc = ", ".join(f"stage {s} at action {at[s]} ({schedule[s][at[s]]})" for s in stuck)
        raise ConfigError(f"schedule deadlocks: {len(stuck)} stage(s) wait forever: {desc}")

    breakdown, T = _breakdown(prog, schedule, starts, ends, clock, wait_s, hol_s, dp, copy_s)
    return SimResult(iteration_time_s=T, busy_s=tuple(prog.busy_s), breakdown=breakdown, schedule=schedule,
                     comm_model=comm_model, start_s=starts, end_s=ends, tx_start_s=tx_start,
                     arrival_s=arrival, n_links=L)


def _breakdown(prog: _Program, schedule: Schedule, starts, ends, clock, wait_s, hol_s, dp, copy_s):
    S = len(prog.progs)
    stage_end, startup = [], []
    for s in range(S):
        end = clock[s]
        lw = prog.last_weight[s]
        if dp[s] > 0 and lw >= 0:
            end = max(end, ends[s][lw] + dp[s])  # all-reduce starts with the last weight gradient
        stage_end.append(end)
        waits = [ends[s][k] - starts[s][k] - copy_s
                 for k in range(prog.first_compute[s]) if schedule[s][k].op.is_recv]
        startup.append(sum(waits, 0.0))
    T = max(stage_end)
    out = []
    for s in range(S):
        n_copies = sum(1 for x in prog.progs[s] if x[0] == _SEND_DEL or x[0] == _RECV_H2D) if copy_s else 0
        out.append(StageBreakdown(
            compute_s=prog.busy_s[s], copy_s=n_copies * copy_s, startup_s=startup[s],
            dependency_s=wait_s[s] - startup[s], hol_s=hol_s[s], dp_allreduce_s=stage_end[s] - clock[s],
            tail_s=T - stage_end[s]))
    return tuple(out), T


def simulate_iterations(schedules: Sequence[Schedule], costs: StageCosts, link: LinkCosts, comm_model: CommModel, *,
                        delays: Union[Sequence[Optional[Mapping]], DelayFn, None] = None,
                        dp_allreduce_s=None) -> list[float]:
    """Iteration times of consecutive iterations (an optimizer step separates them, so each
    starts from an idle pipeline). ``schedules[i]`` runs iteration i: schedules change only at
    iteration boundaries. ``delays`` is one table per iteration, or one function of
    (link, absolute time) so that delays can change inside an iteration. Repeated
    (schedule, table) pairs reuse the earlier result.
    """
    n = len(schedules)
    if delays is not None and not callable(delays) and len(delays) != n:
        raise ConfigError(f"delays has {len(delays)} per-iteration tables for {n} schedules")
    out: list[float] = []
    cache: dict[tuple, float] = {}
    origin_s = 0.0
    for i, sched in enumerate(schedules):
        if callable(delays):
            t = simulate_iteration(sched, costs, link, comm_model, delays=delays,
                                   dp_allreduce_s=dp_allreduce_s, origin_s=origin_s).iteration_time_s
        else:
            table = normalize_delays(delays[i] if delays is not None else None, costs.num_stages)
            key = (id(sched), tuple(sorted(table.items())))
            if key not in cache:
                cache[key] = simulate_iteration(sched, costs, link, comm_model, delays=table,
                                                dp_allreduce_s=dp_allreduce_s).iteration_time_s
            t = cache[key]
        out.append(t)
        origin_s += t
    return out
