"""The recovery loop (after the authors' code, PKU-DAIR/Hetu PR #9) around
:func:`impl.common.runtime.launch.launch`.

The supervisor is the launching process: ranks report to it through ``launch``'s report
channel (their pids, a heartbeat per step, saves, commits, losses), and a watchdog thread
checks every few milliseconds that each running rank's process is alive (the process
sentinel) and that its heartbeat is fresher than ``hb_timeout_s``. The injected fault: the
victim rank, at its seeded step, asks for its kill, and the supervisor SIGKILLs it (and its
saver process) — a real SIGKILL, only its timing is the victim's. The watchdog then detects
the loss without being told, SIGKILLs the survivors and their savers (stop), ``launch``
raises, the supervisor re-plans on the survivors (``relayout``), relaunches them and they
load the last committed checkpoint with resharding and train on.

``launch`` fits: its report callback is the heartbeat channel, and a failed launch already
tears every process down and raises one line; nothing here needs its own spawn.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import psutil

from impl.common.runtime.launch import launch

from .trainer import TrainSpec, train_rank


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _sigkill(pid: Optional[int]) -> None:
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class Watch:
    """What one launch's ranks reported, and the fault's timeline (wall clock)."""

    hb_timeout_s: float
    target_steps: int  # a rank whose heartbeat reached this is finishing, not failing
    pids: dict = field(default_factory=dict)
    savers: dict = field(default_factory=dict)
    up: dict = field(default_factory=dict)
    hb: dict = field(default_factory=dict)  # rank -> (done, wall time)
    step_s: dict = field(default_factory=dict)  # done -> step seconds (rank 0)
    losses: dict = field(default_factory=dict)  # step -> loss
    stalls: list = field(default_factory=list)
    commits: list = field(default_factory=list)
    saves: list = field(default_factory=list)
    done: set = field(default_factory=set)
    t_kill: Optional[float] = None
    kill: Optional[dict] = None
    t_detect: Optional[float] = None
    detected: Optional[str] = None
    t_stopped: Optional[float] = None
    on_kill: Optional[Callable[[int], None]] = None  # the victim's node goes with it (peer tier)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_report(self, rank: int, item) -> None:
        kind = item[0]
        with self.lock:
            if kind == "pid":
                self.pids[rank] = item[1]
            elif kind == "saver":
                self.savers[rank] = item[2]
            elif kind == "up":
                self.up[rank] = item[2]
            elif kind == "hb":
                _, _, done, t, step_s = item
                self.hb[rank] = (done, time.monotonic())
                if rank == 0:
                    self.step_s[done] = step_s
            elif kind == "loss":
                self.losses.setdefault(item[2], item[3])
            elif kind == "save":
                self.saves.append(item[2])
                self.stalls.append(item[3])
            elif kind == "commit":
                self.commits.append((item[2], item[3]))  # (step, seconds from snapshot to commit)
            elif kind == "done":
                self.done.add(rank)
            elif kind == "kill_me":
                _, victim, done, mid_save, pid, saver_pid, _ = item
                _sigkill(pid)
                _sigkill(saver_pid)
                if self.on_kill is not None:
                    self.on_kill(victim)
                self.t_kill = time.time()
                self.kill = {"rank": victim, "fail_step": done, "mid_save": mid_save}

    def check(self) -> Optional[str]:
        """One watchdog pass: the first rank found dead or silent, or None."""
        now = time.monotonic()
        with self.lock:
            for r, pid in sorted(self.pids.items()):
                if r in self.done or (r in self.hb and self.hb[r][0] >= self.target_steps):
                    continue
                if not alive(pid):
                    return f"rank {r} process gone (pid {pid})"
                if r in self.hb and now - self.hb[r][1] > self.hb_timeout_s:
                    return f"rank {r} silent for {now - self.hb[r][1]:.1f} s (heartbeat timeout {self.hb_timeout_s} s)"
        return None

    def stop_all(self) -> None:
        with self.lock:
            for pid in list(self.pids.values()) + list(self.savers.values()):
                _sigkill(pid)


def _run_launch(spec: TrainSpec, world: int, hb_timeout_s: float, timeout_s: float, label: str,
                on_kill: Optional[Callable[[int], None]] = None):
    w = Watch(hb_timeout_s, spec.steps, on_kill=on_kill)
    stop = threading.Event()

    def watchdog() -> None:
        while not stop.is_set():
            why = w.check()
            if why is not None:
                w.t_detect, w.detected = time.time(), why
                w.stop_all()  # stop the survivors: they would only block on the dead peer
                return
            time.sleep(0.005)

    th = threading.Thread(target=watchdog, daemon=True)
    th.start()
    results, error = None, None
    try:
        results = launch(train_rank, world, (spec,), label=label, timeout_s=timeout_s, on_report=w.on_report,
                         victim=f"rank {spec.kill.rank}" if spec.kill else None).results
    except RuntimeError as e:
        error = e
    finally:
        stop.set()
        th.join(timeout=5)
    w.t_stopped = time.time()
    w.stop_all()  # savers of a failed launch must not write on
    if error is not None and w.kill is None:
        if w.detected:  # the watchdog stopped the launch: say why, not only that a rank died of it
            raise RuntimeError(f"{error} (the watchdog stopped the launch: {w.detected})") from error
        raise error  # not the injected fault: the rank's own error is the news
    return w, results


@dataclass
class Outcome:
    """One job of the recovery experiment (wall clock in seconds)."""

    before: Watch
    after: Optional[Watch]
    results: list  # final launch's rank results
    relayout: object = None
    t_wall_s: float = 0.0
    t_plan_s: float = 0.0
    t_relaunch: float = 0.0
    world_before: int = 0
    committed_on_disk: tuple = ()  # committed steps found when the survivors relaunched
    peer: Optional[dict] = None  # the peer tier: nodes lost, holders read by the relaunch

    def losses(self) -> dict:
        """The run's loss curve: steps before the resume point from the first launch, the rest
        from the final one."""
        final = {}
        for r in self.results:
            final.update(r["losses"])
        start = self.results[0]["start_step"]
        head = {s: v for s, v in self.before.losses.items() if s < start} if self.after is not None else {}
        return {**head, **final}


class Holders:
    """The peer tier's holder processes, one per emulated node (:mod:`impl.common.checkpoint.holder`)."""

    def __init__(self, spec: TrainSpec) -> None:
        self.peer = spec.peer
        self.storage_root = os.path.join(spec.root, spec.backend)
        self.procs: dict = {}
        self.lost: list = []
        self.pids: list = []  # every holder started (all gone once the job ends)

    def start(self, nodes, min_step: int = 0) -> None:
        import multiprocessing as mp

        from impl.common.checkpoint.holder import HolderSpec, holder_main

        ctx = mp.get_context("fork")  # up in milliseconds; it imports nothing heavy
        for n in nodes:
            hs = HolderSpec(self.peer.base, n, self.storage_root, self.peer.copies, self.peer.num_nodes,
                            self.peer.net, min_step)
            p = ctx.Process(target=holder_main, args=(hs,), daemon=True, name=f"holder{n}")
            p.start()
            self.procs[n] = p
            self.pids.append(p.pid)

    def kill_node_of(self, rank: int, node_of) -> None:
        """A rank's SIGKILL takes its node's holder and that node's memory."""
        from impl.common.checkpoint.holder import drop_node

        n = node_of[rank]
        p = self.procs.pop(n, None)
        if p is not None:
            _sigkill(p.pid)
            p.join(timeout=5)
        drop_node(self.peer.base, n)
        self.lost.append(n)

    def live(self) -> tuple:
        return tuple(sorted(n for n, p in self.procs.items() if p.is_alive()))

    def stop(self) -> None:
        for p in self.procs.values():
            _sigkill(p.pid)
            p.join(timeout=5)
        self.procs.clear()


def run(spec: TrainSpec, relayout: Optional[Callable[[list], object]] = None, hb_timeout_s: float = 10.0,
        timeout_s: float = 600.0) -> Outcome:
    """Train ``spec``; if its fault fires, re-lay out the survivors with ``relayout(lost)``
    (a :class:`~impl.ckpt_recovery.recovery.replan.Relayout`), relaunch and train on. With
    ``spec.peer`` one holder process per emulated node keeps the peer copies; the victim's
    node loses its holder, and the relaunch reads from the holders that survived."""
    hold = Holders(spec) if spec.peer is not None else None
    try:
        if hold is not None:
            hold.start(range(spec.peer.num_nodes))
        return _run(spec, relayout, hb_timeout_s, timeout_s, hold)
    finally:
        if hold is not None:
            hold.stop()


def _run(spec: TrainSpec, relayout, hb_timeout_s: float, timeout_s: float, hold: Optional[Holders]) -> Outcome:
    t0 = time.time()
    world = sum(len(s.ranks) for s in spec.stages)
    on_kill = (lambda r: hold.kill_node_of(r, spec.peer.node_of)) if hold is not None else None
    w1, res = _run_launch(spec, world, hb_timeout_s, timeout_s, "train", on_kill)
    if res is not None:
        return Outcome(w1, None, res, t_wall_s=time.time() - t0, world_before=world)
    if relayout is None:
        raise RuntimeError(f"train: {w1.detected} and no relayout given")
    lost = [w1.kill["rank"]] if w1.kill else [int(w1.detected.split()[1])]
    on_disk = committed_steps(os.path.join(spec.root, spec.backend))
    lay = relayout(lost)
    spec2 = dataclasses.replace(spec, stages=lay.stages, micro_batches=lay.micro_batches, resume=True, kill=None)
    if hold is not None:
        # The control plane knows the last commit (as it knows who is alive): the survivors
        # load it without asking the storage tier's pointer.
        node_of = tuple(spec.peer.node_of[d] for d in lay.device_of)
        live = hold.live()
        resume = spec.resume_step if spec.resume_step is not None else (max(on_disk) if on_disk else None)
        spec2 = dataclasses.replace(spec2, resume_step=resume,
                                    peer=dataclasses.replace(spec.peer, node_of=node_of, live_nodes=live))
        # a fresh holder where a survivor runs on a node whose holder died (empty: copies from
        # the next commit on)
        hold.start(sorted(set(node_of) - set(live)), min_step=(resume or 0) + 1)
    t_rel = time.time()
    w2, res2 = _run_launch(spec2, lay.world, hb_timeout_s, timeout_s, "recovered")
    if res2 is None:
        raise RuntimeError(f"recovered: {w2.detected}")
    out = Outcome(w1, w2, res2, lay, time.time() - t0, lay.t_plan_s, t_rel, world, on_disk)
    if hold is not None:
        out.peer = {"lost_nodes": list(hold.lost), "live_nodes": list(spec2.peer.live_nodes), "holder_pids": hold.pids}
    return out


def committed_steps(root: str) -> tuple:
    """Steps committed under ``root``: DCP's dirs with ``.metadata``; ours up to the pointer
    (a dir renamed into place by a commit killed before its pointer write does not count)."""
    from impl.common.checkpoint.store import POINTER

    out = []
    for d in os.listdir(root) if os.path.isdir(root) else ():
        if d.startswith("step") and d[4:].isdigit() and any(
                os.path.exists(os.path.join(root, d, f)) for f in ("manifest.json", ".metadata")):
            out.append(int(d[4:]))
    ptr = os.path.join(root, POINTER)
    if any(os.path.exists(os.path.join(root, f"step{s:08d}", "manifest.json")) for s in out):
        pointed = int(open(ptr).read().strip()[4:]) if os.path.exists(ptr) else -1
        out = [s for s in out if s <= pointed]
    return tuple(sorted(out))


def timeline(o: Outcome) -> dict:
    """The breakdown of the time lost to the failure (impl/ckpt_recovery/README.md, "Time lost per
    failure"), from the recorded timestamps."""
    w1, res = o.before, o.results
    start = res[0]["start_step"]
    after_steps = [v for r in res[:1] for k, v in sorted(r["step_s"].items())]
    step_after = statistics.median(after_steps) if after_steps else float("nan")
    before_steps = [v for k, v in sorted(w1.step_s.items()) if k > 1]  # step 1 pays warm-up
    step_before = statistics.median(before_steps) if before_steps else float("nan")
    t_detect = w1.t_detect - w1.t_kill
    t_stop = w1.t_stopped - w1.t_detect
    t_up = max(r["t_up"] for r in res) - o.t_relaunch
    t_saver = max(r["t_saver_start_s"] for r in res)
    loads = [r["load"] for r in res]
    fail_step = w1.kill["fail_step"]
    rework = (fail_step - start) * step_after
    out = {"t_detect_s": t_detect, "t_stop_s": t_stop, "t_spawn_s": t_up, "t_saver_start_s": t_saver,
           "t_restart_s": t_stop + t_up + t_saver, "t_plan_s": o.t_plan_s,
           "t_load_s": max(x["t_load_s"] for x in loads),
           "t_rework_s": rework, "fail_step": fail_step, "committed_step": start,
           "mid_save": w1.kill["mid_save"], "detected_by": w1.detected,
           "step_s_before": step_before, "step_s_after": step_after,
           "throughput_after_over_before": step_before / step_after,
           "read_calls_per_rank": [x["read_calls"] for x in loads],
           "read_amplification_per_rank": [x["read_amplification"] for x in loads],
           "ranks_before": o.world_before, "ranks_after": len(res)}
    for part in ("t_metadata_s", "t_io_s", "t_assembly_s"):
        if part in loads[0]:
            out[f"t_load_{part[2:]}"] = max(x[part] for x in loads)
    out["t_lost_s"] = out["t_detect_s"] + out["t_restart_s"] + out["t_plan_s"] + out["t_load_s"] + rework
    # ETTR: each step counted once, at its final run's measured time, over the job's wall
    # clock (start-up, failure, recovery, rework and saves included).
    useful = sum(v for k, v in w1.step_s.items() if k <= start) + sum(res[0]["step_s"].values())
    out["ettr"] = useful / o.t_wall_s
    return out

