"""Side by side (not a test): the kept reference simulator (tests/common/sim_reference.py) and the
current simulate_iteration on 1F1B S=128 N=1024 (Python loop, compiled on Action lists, compiled
on a ScheduleTable), alternating in one process, best of 4.
Run from the repo root: PYTHONPATH=. python tests/bench/sim_speed_vs_reference.py
"""
import os
import sys
import time

sys.path.insert(0, "tests/common")
from impl.common.cost import LinkCosts, StageCosts  # noqa: E402
from impl.common.schedule.comm import insert_comm  # noqa: E402
from impl.common.schedule.generators import generate  # noqa: E402
from impl.common.schedule.table import ScheduleTable  # noqa: E402
from impl.common.sim import CommModel, simulate_iteration  # noqa: E402
import sim_reference as R  # noqa: E402

S, N = 128, 1024
sch = insert_comm(generate("1f1b", S, N))
tab = ScheduleTable.from_schedule(sch)
costs, link = StageCosts.uniform(S, 0.25, 0.5, 0.25), LinkCosts.uniform(S)
simulate_iteration(tab, costs, link, CommModel("in_stream"))  # numba JIT / cache load
runs = {
    "reference": lambda: R.simulate_iteration(sch, costs, link, R.CommModel("in_stream")),
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
ref = min(times["reference"])
for name, ts in times.items():
    print(f"{name:24s} " + " ".join(f"{x:.3f}" for x in ts) + f"  best {min(ts):.3f}  {ref / min(ts):5.2f}x")
print(f"load {os.getloadavg()[0]:.2f}")
