"""How busy the host was while a real job ran, and whether that makes the run invalid.

A real timing is only worth comparing if the job had the machine to itself: on a shared 2-core
host CaraServe's cold-start ratio read 1.38x quiet and 1.01x beside other jobs, and the
records could not tell the two apart. :class:`HostLoadProbe` samples the host around the run:

- host CPU busy time from ``/proc/stat`` (user + nice + system + irq + softirq + steal, all
  cores), and this job's own CPU time;
- the job's own processes: this process and its descendants (local ranks, delegates, the
  fork server), and the ranks and agents of the same torchrun job on this host. Each counts
  user + system time of all its threads plus the reaped children's (``children_user`` /
  ``children_system``), so ranks that exit during the run stay counted. Not the process
  group: jobs run side by side by one launcher (joblib workers, submitit's local jobs) or one
  script share it, and each must count the other's CPU as foreign;
- ``foreign_cpu_s`` = host busy - own; ``foreign_cpu_frac`` = foreign / (wall x cores), the
  share of the machine other work took; ``cores_free`` = cores - host busy / wall;
- the 1-minute load average before and after.

Linux only (``/proc/stat``); elsewhere the probe reports ``available: false`` and never
invalidates a run.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

import psutil

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system [idle iowait] irq softirq steal


def host_busy_cpu_s(stat_path: str = "/proc/stat") -> Optional[float]:
    """CPU seconds all cores spent busy since boot (guest time is already in user)."""
    try:
        with open(stat_path, encoding="ascii") as fh:
            first = fh.readline().split()
    except OSError:
        return None
    if not first or first[0] != "cpu":
        return None
    ticks = [int(x) for x in first[1:]]
    return sum(ticks[i] for i in _BUSY_FIELDS if i < len(ticks)) / os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def own_processes() -> list[psutil.Process]:
    """This process, its descendants, and under torchrun every rank of the same elastic run on
    this host (same ``TORCHELASTIC_RUN_ID``) with its agent: two torchrun "nodes" on one host
    are one job, not each other's contention. A sibling job is foreign, whoever started it."""
    me = psutil.Process()
    procs = {me.pid: me}
    try:
        procs.update((p.pid, p) for p in me.children(recursive=True))
    except psutil.Error:
        pass
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id:
        return list(procs.values())

    def add_agent(p: psutil.Process) -> None:
        agent = p.parent()
        if agent is not None and any("torch.distributed.run" in a or "torchrun" in a for a in agent.cmdline()):
            procs.setdefault(agent.pid, agent)

    for p in psutil.process_iter():
        try:
            if p.pid == me.pid:
                add_agent(p)
            elif p.pid not in procs and p.environ().get("TORCHELASTIC_RUN_ID") == run_id:
                procs[p.pid] = p
                add_agent(p)
        except (OSError, psutil.Error):
            continue
    return list(procs.values())


def own_cpu_s() -> float:
    total = 0.0
    for p in own_processes():
        try:
            total += _proc_cpu_s(p)
        except psutil.Error:  # exited between listing and reading: its time is in its reaper
            continue
    return total


@dataclass
class _Sample:
    wall: float
    busy: Optional[float]
    own: float
    load1: Optional[float]


def _sample() -> _Sample:
    try:
        load1: Optional[float] = os.getloadavg()[0]
    except OSError:
        load1 = None
    return _Sample(time.monotonic(), host_busy_cpu_s(), own_cpu_s(), load1)


class HostLoadProbe:
    """``start()`` before the timed work, ``stop()`` after; ``stop`` returns the record's
    ``host_load`` object."""

    def __init__(self) -> None:
        self._start: Optional[_Sample] = None
        self._cores = psutil.cpu_count() or os.cpu_count() or 1

    def start(self) -> "HostLoadProbe":
        self._start = _sample()
        return self

    def stop(self) -> dict:
        if self._start is None:
            raise RuntimeError("HostLoadProbe.stop() before start()")
        a, b = self._start, _sample()
        wall = max(b.wall - a.wall, 1e-9)
        out: dict = {"available": a.busy is not None and b.busy is not None,
                     "wall_s": round(wall, 4), "cpu_count": self._cores,
                     "load_avg_1m_before": a.load1, "load_avg_1m_after": b.load1,
                     "own_cpu_s": round(b.own - a.own, 4)}
        if out["available"]:
            busy = b.busy - a.busy
            # Tick granularity (10 ms per core) and sampling skew can make this slightly < 0.
            foreign = max(busy - (b.own - a.own), 0.0)
            out.update(busy_cpu_s=round(busy, 4), foreign_cpu_s=round(foreign, 4),
                       foreign_cpu_frac=round(foreign / (wall * self._cores), 4),
                       cores_free=round(max(self._cores - busy / wall, 0.0), 3))
        return out


def contention_reason(load: dict, max_foreign_cpu_frac: Optional[float]) -> Optional[str]:
    """The invalid reason for a run whose host was busier than the bound, else None."""
    if max_foreign_cpu_frac is None or not load.get("available"):
        return None
    frac = load["foreign_cpu_frac"]
    if frac <= max_foreign_cpu_frac:
        return None
    return (f"host contended: other processes took {frac:.0%} of the host's CPU time "
            f"({load['foreign_cpu_s']:.2f} s on {load['cpu_count']} cores over "
            f"{load['wall_s']:.2f} s; bound validity.max_foreign_cpu_frac={max_foreign_cpu_frac:g})")
