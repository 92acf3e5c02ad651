"""Discrete-event simulation of one pipeline-parallel iteration over an explicit schedule.

Input is schedule data with SEND/RECV actions (as ``insert_comm`` writes them); the simulator
knows no scheduling policy. Each stage has one compute stream that runs its action list in
order, except that by default (``CommModel.batch_p2p``) each run of consecutive SEND/RECV
actions is posted as one batch, sends first, like Megatron's batch_isend_irecv. Messages are
eager: the receiver buffers, so a send never waits for the matching RECV (the HOL model [R]
of impl/adaptra/README.md uses send queues, not a rendezvous).

Comm models (:class:`CommModel`):
- ``latency``: arrival = send time + base + delay, messages independent (no queueing, no
  HOL). This is the model of ADAPTRA's Alg. 3 (paper); with batch_p2p it reproduces
  the ZB simulator reference of impl/adaptra/README.md exactly (tests/common/test_sim_pipeline.py).
- ``in_stream`` (GPU path, the HOL model [R] of impl/adaptra/README.md): one FIFO worker per
  (stage, peer, direction). A SEND hands its message to the worker and returns, unless the worker already holds
  ``queue_depth`` messages not yet delivered; then the stream blocks until the oldest is
  delivered (head-of-line blocking). The worker sends one message at a time, each taking
  base + delay, so a delayed link carries at most 1/(base + delay) messages per second.
- ``blocking`` (inline sends on the compute thread, the real runtime's ``inline`` path): a
  SEND holds the stream until the message is delivered (base + delay); the stream's time in
  it counts as HOL. Run with ``batch_p2p=False``: blocking sends go in schedule order.
- ``delegated`` (host delegates, ADAPTRA's CPU-delegated data plane): a SEND costs a D2H copy on
  the stream; micro-batch j then goes to delegate j mod K of (stage, direction), which sends serially with
  base·cpu_penalty + delay per message (queues unbounded, throughput K/c). Before the
  consuming op the receiver's stream waits for arrival and then pays an H2D copy.

Per-link delays ``{(i, i+1): seconds}`` apply to every message on that link, both directions.
The run is a dataflow over the stages, resumed off a heap in the EventLoop's (time, insertion)
order: a stage runs ahead until a RECV whose message has not been produced yet, and is resumed
at that message's arrival time.
Since every input to an action's timing is known when it is computed, the result does not
depend on the processing order, and it is bit-reproducible.

Two engines run this algorithm: the Python loop below, and the same loop compiled with numba
(``compiled.py``) over a columnar :class:`ScheduleTable`, with the same float operations in the
same order (bit-identical results; 1F1B at S=128, N=1024 takes ~0.03-0.05 s there on a
table against ~0.6 s here). ``engine="auto"`` compiles for tables and for schedules of 20k actions or more; a
time-varying delay function always runs in the Python loop (it is Python code, called in
time order).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from functools import cached_property
from heapq import heappop, heappush
from typing import Callable, Mapping, NamedTuple, Optional, Sequence, Union

import numpy as np

from impl.common.api import ConfigError
from impl.common.cost.comm import LinkCosts
from impl.common.cost.transformer import StageCosts
from impl.common.schedule.ir import Action, Op, Schedule
from impl.common.schedule.table import RECV_B, RECV_F, ScheduleTable

from impl.common.sim.delays import normalize_delays

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


class _Timeline:
    """Per-action and per-message times. The Python engine fills lists; the compiled engine
    leaves flat arrays (and, for a table input, no ``Action`` lists), turned into the same
    lists on first read, so callers that only want the iteration time never pay for them."""

    def __init__(self, *, schedule: Optional[Schedule] = None, table: Optional[ScheduleTable] = None,
                 start_s=None, end_s=None, tx_start_s=None, arrival_s=None) -> None:
        self._schedule, self._table = schedule, table
        self._start, self._end, self._tx, self._arrival = start_s, end_s, tx_start_s, arrival_s

    def _rows(self, flat) -> list[list[float]]:
        if isinstance(flat, list):
            return flat
        off = self._table.offsets.tolist()
        values = flat.tolist()
        return [values[off[s]:off[s + 1]] for s in range(len(off) - 1)]

    @cached_property
    def schedule(self) -> Schedule:
        return self._schedule if self._schedule is not None else self._table.to_schedule()

    @cached_property
    def start_s(self) -> list[list[float]]:
        return self._rows(self._start)

    @cached_property
    def end_s(self) -> list[list[float]]:
        return self._rows(self._end)

    @cached_property
    def tx_start_s(self) -> list[float]:
        return self._tx if isinstance(self._tx, list) else self._tx.tolist()

    @cached_property
    def arrival_s(self) -> list[Optional[float]]:
        if isinstance(self._arrival, list):
            return self._arrival
        out: list = self._arrival.tolist()
        for m in np.flatnonzero(np.isnan(self._arrival)).tolist():
            out[m] = None
        return out


@dataclass
class PipelineSimResult:
    iteration_time_s: float
    busy_s: tuple[float, ...]  # compute per stage
    breakdown: tuple[StageBreakdown, ...]
    comm_model: CommModel
    n_links: int
    _timeline: _Timeline = field(repr=False, compare=False)

    @property
    def schedule(self) -> Schedule:
        return self._timeline.schedule

    @property
    def start_s(self) -> list[list[float]]:  # [stage][action index]
        return self._timeline.start_s

    @property
    def end_s(self) -> list[list[float]]:
        return self._timeline.end_s

    @property
    def tx_start_s(self) -> list[float]:  # per message id (dense ids, see _decode_key): the worker/delegate starts sending
        return self._timeline.tx_start_s

    @property
    def arrival_s(self) -> list[Optional[float]]:  # data at the receiver (before any H2D copy); None: id unused
        return self._timeline.arrival_s

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


# Compiled schedule: per stage, parallel flat lists (code, arg, schedule index) in execution
# order. A send's worker and link follow from its direction and stage, so the program holds
# no per-action tuple (S=128, N=1024 is 800k actions).
_COMPUTE, _SEND_F, _SEND_B, _RECV = range(4)


@dataclass
class _Program:
    codes: list  # [stage] -> program codes in execution order
    args: list  # [stage] -> compute: duration (s); SEND/RECV: message id
    order: list  # [stage] -> schedule index of each program position
    busy_s: list  # [stage] compute seconds
    first_compute: list  # [stage] schedule index of the first compute action (len if none)
    last_weight: list  # [stage] index of the last W/BW (else last compute; -1 if none)
    n_comm: list  # [stage] SEND/RECV actions (each one a copy on the delegated path)
    n_keys: int  # message ids are dense keys (see _decode_key); unused keys stay None
    n_workers: int


def _decode_key(m: int, n_links: int) -> Message:
    """Message ids are pre-indexed as ``(mb·n_links + link)·2 + forward`` (no lookup table)."""
    forward = bool(m & 1)
    mb, link = divmod(m >> 1, n_links)
    return Message(link, link + 1, True, mb) if forward else Message(link + 1, link, False, mb)


def _compile(schedule: Schedule, costs: StageCosts, link: LinkCosts, comm: CommModel) -> _Program:
    """Schedule -> per-stage (code, arg, index) lists in one pass over the actions, checking every
    message is sent and received once (the first bad action is reported)."""
    S = costs.num_stages
    _check_shape(sorted(schedule), S, link)
    L = max(S - 1, 1)
    n_keys = 2 * L * 64  # grown on demand
    sent, received = bytearray(n_keys), bytearray(n_keys)
    batch = comm.batch_p2p
    out = _Program([], [], [], [], [], [], [], 0, 0)
    for s in range(S):
        tf, tb, tw = costs.tf_s[s], costs.tb_s[s], costs.tw_s[s]
        dur = {"F": tf, "B": tb, "W": tw, "BW": tb + tw}
        # op -> (program code, forward message, link index, the only legal peer)
        comm_of = {"SF": (_SEND_F, 1, s, s + 1), "RB": (_RECV, 0, s, s + 1),
                   "RF": (_RECV, 1, s - 1, s - 1), "SB": (_SEND_B, 0, s - 1, s - 1)}
        codes: list = []
        args: list = []
        order: list = []
        held: list = []  # the current batch's receives (schedule index, message), posted after its sends
        total = 0.0
        first, last_w, last_c, n_comm = -1, -1, -1, 0
        row = schedule[s]
        for k, act in enumerate(row):
            v = act.op._value_
            d = dur.get(v)
            if d is not None:
                if held:
                    _post(held, codes, args, order)
                    held = []
                codes.append(_COMPUTE)
                args.append(d)
                order.append(k)
                total += d
                last_c = k
                if first < 0:
                    first = k
                if v == "W" or v == "BW":
                    last_w = k
                continue
            code, fwd, lk, peer = comm_of[v]
            if act.peer != peer or not 0 <= lk < S - 1:
                raise ConfigError(f"stage {s} action {k} ({act}): its peer must be the "
                                  f"{'next' if peer > s else 'previous'} stage {peer}, within 0..{S - 1}")
            n_comm += 1
            m = (act.mb * L + lk) * 2 + fwd  # see _decode_key
            if m >= n_keys:
                grow = max(n_keys, m + 1 - n_keys)
                sent.extend(bytes(grow))
                received.extend(bytes(grow))
                n_keys += grow
            if code != _RECV:
                if sent[m]:
                    raise ConfigError(f"stage {s} action {k} ({act}): message sent twice")
                sent[m] = 1
            else:
                if received[m]:
                    raise ConfigError(f"stage {s} action {k} ({act}): message received twice")
                received[m] = 1
                if batch:
                    held.append((k, m))
                    continue
            codes.append(code)
            args.append(m)
            order.append(k)
        _post(held, codes, args, order)
        out.codes.append(codes)
        out.args.append(args)
        out.order.append(order)
        out.busy_s.append(total)
        out.first_compute.append(first if first >= 0 else len(row))
        out.last_weight.append(last_w if last_w >= 0 else last_c)
        out.n_comm.append(n_comm)
    if sent != received:
        m = next(i for i in range(n_keys) if sent[i] != received[i])
        msg = _decode_key(m, L)
        what = "received but never sent" if received[m] else "sent but never received"
        raise ConfigError(f"message {'F' if msg.forward else 'B'}{msg.mb} {msg.src}->{msg.dst} is {what}")
    out.n_keys = n_keys
    out.n_workers = 2 * S * (comm.delegates if comm.kind == "delegated" else 1)
    return out


def _post(held: list, codes: list, args: list, order: list) -> None:
    """Append a batch's held receives to the program, after its sends (batch_p2p)."""
    for k, m in held:
        codes.append(_RECV)
        args.append(m)
        order.append(k)


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


ENGINES = ("auto", "python", "compiled")
# engine="auto" compiles from this many actions on (below it the Python loop takes < 10 ms
# and a process never imports numba); a ScheduleTable always goes to the compiled engine.
COMPILED_MIN_ACTIONS = 20_000


def simulate_iteration(schedule: Union[Schedule, ScheduleTable], costs: StageCosts, link: LinkCosts,
                       comm_model: CommModel, *, delays: Delays = None, dp_allreduce_s=None, origin_s: float = 0.0,
                       engine: str = "auto") -> PipelineSimResult:
    """Simulate one iteration starting at time 0.

    ``schedule``: ``Action`` lists or the same as a :class:`ScheduleTable` (convert once when one
    schedule is simulated many times). ``delays``: ``{(i, i+1): seconds}`` per message, or a
    function ``(i, t_abs_s) -> seconds`` evaluated when a message starts sending (t_abs_s =
    origin_s + local time), for delays that change within an iteration. ``dp_allreduce_s`` (one
    value or one per stage): gradient all-reduce started when the stage's last W (or BW) ends;
    the stage is done when both its stream and the all-reduce are. ``engine``: ``python`` (the
    loop below), ``compiled`` (the same algorithm compiled with numba, bit-identical results;
    delay tables only), or ``auto`` (compiled for tables and large schedules without a delay
    function).
    """
    S = costs.num_stages
    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    delay_fn: Optional[DelayFn] = delays if callable(delays) else None
    if engine == "compiled" and delay_fn is not None:
        raise ConfigError("engine='compiled' takes a delay table, not a delay function; use engine='python' or 'auto'")
    is_table = isinstance(schedule, ScheduleTable)
    stages = list(range(schedule.num_stages)) if is_table else sorted(schedule)
    _check_shape(stages, S, link)
    table = {} if delay_fn is not None else normalize_delays(delays, S)
    dp = _per_stage(dp_allreduce_s, S, "dp_allreduce_s")
    penalty = comm_model.cpu_penalty if comm_model.kind == "delegated" else 1.0
    base_s = [p * penalty for p in link.p2p_s]
    link_cost_s = [b + table.get((i, i + 1), 0.0) for i, b in enumerate(base_s)]
    copy_s = link.copy_s if comm_model.kind == "delegated" else 0.0
    L = max(S - 1, 1)
    if engine == "compiled" or (engine == "auto" and delay_fn is None and (
            is_table or sum(map(len, schedule.values())) >= COMPILED_MIN_ACTIONS)):
        return _simulate_compiled(schedule, costs, link, comm_model, link_cost_s, dp, copy_s)
    if is_table:
        schedule = schedule.to_schedule()
    prog = _compile(schedule, costs, link, comm_model)
    run = _run(prog, comm_model, base_s, link_cost_s, delay_fn, origin_s, copy_s)
    starts, ends, clock, wait_s, hol_s, tx_start, arrival, pc = run

    stuck = [s for s in range(S) if pc[s] < len(prog.codes[s])]
    if stuck:
        _deadlock({s: prog.order[s][pc[s]] for s in stuck}, lambda s, k: schedule[s][k])

    startup = [sum([ends[s][k] - starts[s][k] - copy_s for k in range(prog.first_compute[s])
                    if schedule[s][k].op.is_recv], 0.0) for s in range(S)]
    weight_end = [ends[s][lw] if lw >= 0 else None for s, lw in enumerate(prog.last_weight)]
    breakdown, T = _breakdown(prog.busy_s, weight_end, prog.n_comm, startup, clock, wait_s, hol_s, dp, copy_s)
    return PipelineSimResult(iteration_time_s=T, busy_s=tuple(prog.busy_s), breakdown=breakdown, comm_model=comm_model,
                     n_links=L, _timeline=_Timeline(schedule=schedule, start_s=starts, end_s=ends,
                                                    tx_start_s=tx_start, arrival_s=arrival))


def _check_shape(stages: list, S: int, link: LinkCosts) -> None:
    if stages != list(range(S)):
        raise ConfigError(f"schedule stages {stages} do not match the {S} stages of the costs")
    if len(link.p2p_s) != S - 1:
        raise ConfigError(f"LinkCosts.p2p_s has {len(link.p2p_s)} links, pipeline of {S} stages needs {S - 1}")


def _deadlock(at: dict, action_at: Callable[[int, int], Action]) -> None:
    desc = ", ".join(f"stage {s} at action {k} ({action_at(s, k)})" for s, k in at.items())
    raise ConfigError(f"schedule deadlocks: {len(at)} stage(s) wait forever: {desc}")


def _simulate_compiled(schedule, costs: StageCosts, link: LinkCosts, comm: CommModel, link_cost_s, dp,
                       copy_s: float) -> PipelineSimResult:
    try:
        from impl.common.sim import compiled
    except ImportError as exc:  # numba is a dependency; say so instead of silently running slower
        raise ConfigError(f"engine='compiled' needs numba ({exc}); install the project's dependencies "
                          "or pass engine='python'") from exc
    S = costs.num_stages
    tab = schedule if isinstance(schedule, ScheduleTable) else ScheduleTable.from_schedule(schedule)
    f64 = np.float64
    (ok, pcode, pdur, pmsg, porder, busy, first, last_weight, n_comm, n_keys, n_send) = compiled.compile_program(
        tab.offsets, tab.op, tab.mb, tab.peer, np.asarray(costs.tf_s, f64), np.asarray(costs.tb_s, f64),
        np.asarray(costs.tw_s, f64), comm.batch_p2p)
    if not ok:  # the Python compile names the first bad action (same message for both engines)
        _compile(schedule if not isinstance(schedule, ScheduleTable) else tab.to_schedule(), costs, link, comm)
        raise RuntimeError("compiled and Python schedule checks disagree; please report this schedule")
    K = comm.delegates if comm.kind == "delegated" else 1
    kind = COMM_KINDS.index(comm.kind)  # the order compiled.LATENCY.. follows
    Q = comm.queue_depth if comm.queue_depth is not None else sys.maxsize
    cost_f = np.array([link_cost_s[s] if s < S - 1 else 0.0 for s in range(S)], f64)
    cost_b = np.array([link_cost_s[s - 1] if s > 0 else 0.0 for s in range(S)], f64)
    starts, ends, clock, wait_s, hol_s, tx_start, arrival, pc = compiled.run_program(
        tab.offsets, pcode, pdur, pmsg, porder, n_send, n_keys, 2 * S * K, kind, K, Q, copy_s, cost_f, cost_b)
    off = tab.offsets.tolist()
    pc = pc.tolist()
    stuck = [s for s in range(S) if pc[s] < off[s + 1] - off[s]]
    if stuck:
        _deadlock({s: int(porder[off[s] + pc[s]]) for s in stuck}, tab.action)
    first, last_weight = first.tolist(), last_weight.tolist()
    startup = []
    for s in range(S):
        head = tab.op[off[s]:off[s] + first[s]]  # the actions before the stage's first compute op
        idx = (np.flatnonzero((head == RECV_F) | (head == RECV_B)) + off[s]).tolist()
        startup.append(sum([e - b - copy_s for e, b in zip(ends[idx].tolist(), starts[idx].tolist())], 0.0))
    weight_end = [float(ends[off[s] + lw]) if lw >= 0 else None for s, lw in enumerate(last_weight)]
    busy = busy.tolist()
    breakdown, T = _breakdown(busy, weight_end, n_comm.tolist(), startup, clock.tolist(), wait_s.tolist(),
                              hol_s.tolist(), dp, copy_s)
    return PipelineSimResult(iteration_time_s=T, busy_s=tuple(busy), breakdown=breakdown, comm_model=comm,
                     n_links=max(S - 1, 1), _timeline=_Timeline(
                         schedule=None if isinstance(schedule, ScheduleTable) else schedule, table=tab,
                         start_s=starts, end_s=ends, tx_start_s=tx_start, arrival_s=arrival))


class _Run(NamedTuple):
    start_s: list
    end_s: list
    clock: list  # [stage] stream time where it stopped
    wait_s: list  # [stage] time blocked on RECV
    hol_s: list  # [stage] time blocked on a SEND
    tx_start_s: list
    arrival_s: list
    pc: list  # [stage] program position it stopped at (len = finished)


def _run(prog: _Program, comm: CommModel, base_s, link_cost_s, delay_fn, origin_s: float, copy_s: float) -> _Run:
    """The dataflow over the stages: a stage runs ahead until a RECV whose message has not been
    sent yet, and is resumed once it is sent. Every time is computed from the stage's own state
    and arrival times that are final when set, so the resumption order does not change any
    result: without a delay function the woken stages go on a plain stack (the heap keyed by
    time cost ~0.05 s of 0.28 at S=128, N=1024); a delay function, which may keep state, is
    called in the EventLoop's (time, insertion) order, from a heap."""
    S = len(prog.codes)
    L = max(S - 1, 1)
    kind = comm.kind
    queued, delegated, blocking, latency = (kind == "in_stream", kind == "delegated",
                                            kind == "blocking", kind == "latency")
    K = comm.delegates if delegated else 1
    Q = comm.queue_depth if comm.queue_depth is not None else sys.maxsize
    arrival: list = [None] * prog.n_keys
    tx_start = [0.0] * prog.n_keys
    waiter = [-1] * prog.n_keys
    wfree = [0.0] * prog.n_workers  # when each worker/delegate finishes its last message
    wdone: list[list[float]] = [[] for _ in range(prog.n_workers)]  # in_stream: delivery times
    starts = [[0.0] * len(c) for c in prog.codes]
    ends = [[0.0] * len(c) for c in prog.codes]
    pc = [0] * S
    clock = [0.0] * S
    wait_s = [0.0] * S
    hol_s = [0.0] * S
    # per stage, what a resumption needs; forward sends use worker 2s+1 on link s, backward
    # ones worker 2s on link s-1
    ctx = [(prog.codes[s], prog.args[s], prog.order[s], starts[s], ends[s], len(prog.codes[s]),
            2 * s + 1, 2 * s, link_cost_s[s] if s < S - 1 else 0.0, link_cost_s[s - 1] if s > 0 else 0.0)
           for s in range(S)]
    ordered = delay_fn is not None
    # ordered: heap of (time, seq, stage); else a stack of stages (stage 0 on top)
    queue = [(0.0, s, s) for s in range(S)] if ordered else list(range(S - 1, -1, -1))
    seq = S
    while queue:
        s = heappop(queue)[2] if ordered else queue.pop()
        codes, args, order, st, en, n, wf, wb, cf, cb = ctx[s]
        t, wait, hol = clock[s], wait_s[s], hol_s[s]
        k = n
        for i in range(pc[s], n):
            code = codes[i]
            a = args[i]
            x = order[i]
            st[x] = t
            if code == _COMPUTE:
                t += a
            elif code == _RECV:
                arr = arrival[a]
                if arr is None:  # sleep until the producer sends it
                    waiter[a] = s
                    k = i
                    break
                if arr > t:
                    wait += arr - t
                    t = arr
                if delegated:
                    t += copy_s  # H2D before the consumer
            else:
                b, c = (wf, cf) if code == _SEND_F else (wb, cb)
                if delegated:
                    b = b * K + ((a >> 1) // L) % K  # micro-batch j goes to delegate j mod K
                if queued:
                    done = wdone[b]
                    if len(done) >= Q and done[-Q] > t:  # worker full: head-of-line block
                        hol += done[-Q] - t
                        t = done[-Q]
                    tx0 = t if t > wfree[b] else wfree[b]
                elif delegated:
                    t += copy_s  # D2H into the pinned slot before the delegate can see it
                    tx0 = t if t > wfree[b] else wfree[b]
                elif blocking:
                    tx0 = t if t > wfree[b] else wfree[b]
                else:
                    tx0 = t
                if delay_fn is not None:
                    lk = (a >> 1) % L
                    c = base_s[lk] + delay_fn(lk, origin_s + tx0)
                tx1 = tx0 + c
                if not latency:
                    wfree[b] = tx1
                    if queued:
                        wdone[b].append(tx1)
                if blocking:  # the stream itself sleeps the delay and sends
                    hol += tx1 - t
                    t = tx1
                tx_start[a] = tx0
                arrival[a] = tx1
                w = waiter[a]
                if w >= 0:
                    waiter[a] = -1
                    if ordered:
                        heappush(queue, (tx1, seq, w))
                        seq += 1
                    else:
                        queue.append(w)
            en[x] = t
        pc[s], clock[s] = k, t
        wait_s[s], hol_s[s] = wait, hol
    return _Run(starts, ends, clock, wait_s, hol_s, tx_start, arrival, pc)


def _breakdown(busy_s, weight_end, n_comm, startup, clock, wait_s, hol_s, dp, copy_s):
    """``weight_end[s]``: when the stage's last W/BW (else last compute) ends; None if it has none."""
    S = len(busy_s)
    stage_end = []
    for s in range(S):
        end = clock[s]
        if dp[s] > 0 and weight_end[s] is not None:
            end = max(end, weight_end[s] + dp[s])  # all-reduce starts with the last weight gradient
        stage_end.append(end)
    T = max(stage_end)
    out = []
    for s in range(S):
        n_copies = n_comm[s] if copy_s else 0
        out.append(StageBreakdown(
            compute_s=busy_s[s], copy_s=n_copies * copy_s, startup_s=startup[s],
            dependency_s=wait_s[s] - startup[s], hol_s=hol_s[s], dp_allreduce_s=stage_end[s] - clock[s],
            tail_s=T - stage_end[s]))
    return tuple(out), T


def simulate_iterations(schedules: Sequence[Union[Schedule, ScheduleTable]], costs: StageCosts, link: LinkCosts,
                        comm_model: CommModel, *, delays: Union[Sequence[Optional[Mapping]], DelayFn, None] = None,
                        dp_allreduce_s=None, engine: str = "auto") -> list[float]:
    """Iteration times of consecutive iterations (an optimizer step separates them, so each
    starts from an idle pipeline). ``schedules[i]`` runs iteration i: schedules change only at
    iteration boundaries. ``delays`` is one table per iteration, or one function of
    (link, absolute time) so that delays can change inside an iteration. Repeated
    (schedule, table) pairs reuse the earlier result; a large schedule that runs under several
    tables is turned into a ScheduleTable once (``engine`` as in :func:`simulate_iteration`).
    """
    n = len(schedules)
    tables: dict[int, ScheduleTable] = {}
    if delays is not None and not callable(delays) and len(delays) != n:
        raise ConfigError(f"delays has {len(delays)} per-iteration tables for {n} schedules")
    out: list[float] = []
    cache: dict[tuple, float] = {}
    origin_s = 0.0
    for i, sched in enumerate(schedules):
        if callable(delays):
            t = simulate_iteration(sched, costs, link, comm_model, delays=delays, dp_allreduce_s=dp_allreduce_s,
                                   origin_s=origin_s, engine=engine).iteration_time_s
        else:
            table = normalize_delays(delays[i] if delays is not None else None, costs.num_stages)
            key = (id(sched), tuple(sorted(table.items())))
            if key not in cache:
                if (engine != "python" and not isinstance(sched, ScheduleTable)
                        and sorted(sched) == list(range(costs.num_stages))  # else simulate_iteration names it
                        and sum(map(len, sched.values())) >= COMPILED_MIN_ACTIONS):
                    if id(sched) not in tables:
                        tables[id(sched)] = ScheduleTable.from_schedule(sched)
                    run_on = tables[id(sched)]
                else:
                    run_on = sched
                cache[key] = simulate_iteration(run_on, costs, link, comm_model, delays=table,
                                                dp_allreduce_s=dp_allreduce_s, engine=engine).iteration_time_s
            t = cache[key]
        out.append(t)
        origin_s += t
    return out
