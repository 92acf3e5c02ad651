"""Side by side (not a test): the kept reference simulator (tests/common/sim_reference.py) and
the current simulate_iteration on 1F1B S=128 N=1024, alternating in one process, best of 4.
Run from the repo root: PYTHONPATH=. python tests/bench/sim_speed_vs_reference.py
"""
import time, sys, os
sys.path.insert(0, "tests/common")
from impl.common.cost import LinkCosts, StageCosts
from impl.common.schedule.comm import insert_comm
from impl.common.schedule.generators import generate
from impl.common.sim import CommModel, simulate_iteration
import sim_reference as R
S,N=128,1024
sch=insert_comm(generate("1f1b",S,N))
costs=StageCosts.uniform(S,0.25,0.5,0.25); link=LinkCosts.uniform(S)
old,new=[],[]
for _ in range(4):
    t=time.perf_counter(); R.simulate_iteration(sch,costs,link,R.CommModel("in_stream")); old.append(time.perf_counter()-t)
    t=time.perf_counter(); simulate_iteration(sch,costs,link,CommModel("in_stream")); new.append(time.perf_counter()-t)
print("old", " ".join(f"{x:.3f}" for x in old), "best", f"{min(old):.3f}")
print("new", " ".join(f"{x:.3f}" for x in new), "best", f"{min(new):.3f}")
print(f"ratio {min(old)/min(new):.2f}x  load {os.getloadavg()[0]:.2f}")
