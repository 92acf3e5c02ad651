"""Per-stage Gantt chart of one simulated pipeline iteration (like the papers' timelines)."""
from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from impl.common.plots.save import save_png  # noqa: E402
from impl.common.schedule.ir import Op  # noqa: E402

COLORS = {Op.F: "#4c72b0", Op.B: "#dd8452", Op.W: "#55a868", Op.BW: "#c44e52"}


def plot_sim_timeline(result, path: pathlib.Path, title: str) -> pathlib.Path:
    """``result`` is an ``impl.common.sim.pipeline.PipelineSimResult``; compute ops only, in ms."""
    schedule = result.schedule
    fig, ax = plt.subplots(figsize=(11, 0.5 * len(schedule) + 1.5))
    for s in sorted(schedule):
        for k, act in enumerate(schedule[s]):
            if not act.op.is_compute:
                continue
            start, end = result.start_s[s][k] * 1e3, result.end_s[s][k] * 1e3
            ax.broken_barh([(start, end - start)], (s - 0.4, 0.8), facecolors=COLORS[act.op], edgecolor="white",
                           linewidth=0.3)
            if len(schedule[s]) <= 200:
                ax.text((start + end) / 2, s, f"{act.op.value}{act.mb}", ha="center", va="center", fontsize=5,
                        color="white")
    ax.set_yticks(sorted(schedule))
    ax.set_yticklabels([f"stage {s}" for s in sorted(schedule)])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms, simulated)")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, [op.value for op in COLORS], loc="upper right", fontsize=7, ncol=4)
    path = save_png(fig, pathlib.Path(path))
    return path
