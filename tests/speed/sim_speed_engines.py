"""Side by side (not a test): the pipeline simulator's engines on 1F1B S=128 N=1024 (Python
loop, compiled on Action lists, compiled on a ScheduleTable), alternating in one process, best
of 4; ratios against the Python loop.
Run from the repo root: PYTHONPATH=. python tests/speed/sim_speed_engines.py
"""
import os
import time

from impl.common.cost import LinkCosts, StageCosts
from impl.common.schedule.comm import insert_comm
from impl.common.schedule.generators import generate
from impl.common.schedule.table import ScheduleTable
from impl.common.sim import CommModel, simulate_iteration

S, N = 128, 1024
sch = insert_comm(generate("1f1b", S, N))
tab = ScheduleTable.from_schedule(sch)
costs, link = StageCosts.uniform(S, 0.25, 0.5, 0.25), LinkCosts.uniform(S)
simulate_iteration(tab, costs, link, CommModel("in_stream"))  # numba JIT / cache load
runs = {
    "python": lambda: simulate_iteration(sch, costs, link, CommModel("in_stream"), engine="python"),
    "compiled, Action lists": lambda: simulate_iteration(sch, costs, link, CommModel("in_stream")),
    "compiled, ScheduleTable": lambda: simulate_iteration(tab, costs, link, CommModel("in_stream")),
}
times: dict[str, list[float]] = {k: [] for k in runs}
for _ in range(4):
    for name, fn in runs.items():
        t = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - t)
base = min(times["python"])
for name, ts in times.items():
    print(f"{name:24s} " + " ".join(f"{x:.3f}" for x in ts) + f"  best {min(ts):.3f}  {base / min(ts):5.2f}x")
print(f"load {os.getloadavg()[0]:.2f}")
