"""Print a schedule as a step x stage grid, for eyeballing bubbles and comparing schedules.

Two layouts:
* default: row k holds the k-th action of every stage (like torch.distributed.pipelining's
  ``_format_pipeline_order``); exact, but rows of different stages do not line up in time;
* ``aligned=True``: compute ops only, each taking one unit step as soon as its dependencies
  (previous op on the stage, F from the stage above, B/BW from the stage below) are done;
  blank cells are bubbles of a uniform-time pipeline.
"""
from __future__ import annotations

from impl.common.schedule.ir import Op, Schedule
from impl.common.schedule.validate import ScheduleError


def _unit_time_steps(schedule: Schedule) -> dict[int, list[int]]:
    """Start step of each compute op with unit op times and free communication."""
    stages = sorted(schedule)
    rows = {s: [a for a in schedule[s] if a.op.is_compute] for s in stages}
    step = {s: [] for s in stages}
    finished: dict[tuple, int] = {}  # ("F"|"bwd", stage, mb) -> end step
    last = len(stages) - 1
    progress = True
    while progress:
        progress = False
        for s in stages:
            row, out = rows[s], step[s]
            while len(out) < len(row):
                a = row[len(out)]
                dep = None
                if a.op is Op.F and s > 0:
                    dep = ("F", s - 1, a.mb)
                elif a.op in (Op.B, Op.BW) and s < last:
                    dep = ("bwd", s + 1, a.mb)
                if dep is not None and dep not in finished:
                    break
                t = max(out[-1] + 1 if out else 0, finished.get(dep, 0))
                out.append(t)
                key = ("F" if a.op is Op.F else "bwd", s, a.mb)
                if a.op is not Op.W:
                    finished[key] = t + 1
                progress = True
    stuck = [s for s in stages if len(step[s]) < len(rows[s])]
    if stuck:
        raise ScheduleError(f"cannot align schedule: stages {stuck} wait on each other (deadlock)")
    return step


def format_grid(schedule: Schedule, *, aligned: bool = False) -> str:
    """Text grid: one column per stage, one row per step (see module docstring)."""
    stages = sorted(schedule)
    cells: dict[tuple[int, int], str] = {}
    if aligned:
        steps = _unit_time_steps(schedule)
        for s in stages:
            for a, t in zip((a for a in schedule[s] if a.op.is_compute), steps[s]):
                cells[(t, s)] = str(a)
    else:
        for s in stages:
            for k, a in enumerate(schedule[s]):
                cells[(k, s)] = str(a)
    n_rows = 1 + max((t for t, _ in cells), default=-1)
    header = ["step"] + [f"stage {s}" for s in stages]
    body = [[str(t)] + [cells.get((t, s), "") for s in stages] for t in range(n_rows)]
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header] + body]
    return "\n".join(lines)
