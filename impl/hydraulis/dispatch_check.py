"""Our stage 1 dispatch against the authors' planner on their planning cases (README
"Dispatch never worse than the authors' on their planning cases").

- :func:`authors_dispatch` re-states the authors' randomized greedy (Hetu
  ``examples/hydraulis/strategy``, ``process_trial`` of their planner) as they run it, random
  stream included: the batch sorted ascending (their ``sorted_len``), replicas by capacity
  descending, trial t in ``start .. start + trials - 1`` shuffles the sorted batch with Python's
  ``random.seed(t); random.shuffle``; sequences fitting only the first replica go there first,
  the rest in shuffled order by the min-max rule and their tie rule; the best trial wins, and
  the candidate is infeasible as soon as the best trial so far leaves a replica empty.
- :func:`planning_cases` builds their cases: the candidate lists of their scripts
  (``scripts/train_hetu_tencent.sh`` 32B@64; the 32-GPU lists [(16,1)x2], [(16,1),(2,2),(1,4)x3] on 13B;
  the 16-GPU 80 GB lists [(4,2)x2], [(4,2),(1,4)x2] (their [(4,2),(1,8)] has no 80 GB 7B price);
  the A100-40G 16-GPU test lists; ``test_planner.sh`` at 1,024 GPUs), priced as the sim prices
  them, on the sim's batches (seed 0).
- ``python -m impl.hydraulis.dispatch_check`` prints, per case, how often ours is worse than
  theirs on the same objective and by how much (``--refine false`` = the authors' rule with our
  shuffles, ``--budget`` = ``dispatch_budget``).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import random
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from impl.hydraulis.cost.strategy import ReplicaCost


@dataclass(frozen=True)
class AuthorsResult:
    assign: list  # list[list[int]] per replica, in the caller's replica order
    makespan: float
    feasible: bool


def authors_dispatch(lengths: Sequence[int], replicas: Sequence[ReplicaCost], trials: int = 100, start: int = 0,
                     includes_c: bool = False) -> AuthorsResult:
    """The authors' dispatch (see module doc). ``includes_c`` prices a sequence as ours does with
    ``dispatch_includes_c`` (their code: False), so both run on one objective."""
    R = len(replicas)
    order = sorted(range(R), key=lambda r: replicas[r].cap, reverse=True)  # stable, as theirs
    caps = [replicas[r].cap for r in order]
    pp1 = [replicas[r].pp - 1 for r in order]
    srt = sorted(range(len(lengths)), key=lambda i: (int(lengths[i]), i))  # their sorted_len
    if not lengths or int(lengths[srt[-1]]) > caps[0]:
        return AuthorsResult([[] for _ in range(R)], math.inf, False)

    def cost(k: int, x: int) -> tuple[float, float]:
        rc = replicas[order[k]]
        base = rc.a * x * x + rc.b * x
        if includes_c:
            return base + rc.c * x / rc.cap, (base + rc.c) * pp1[k]
        return base, base * pp1[k]

    table = {}
    best, best_res = math.inf, None
    for t in range(start, start + trials):
        random.seed(t)
        idx = list(range(len(srt)))
        random.shuffle(idx)
        acc, warm, res = [0.0] * R, [0.0] * R, [[] for _ in range(R)]
        forced = set()
        for p in idx:
            x = int(lengths[srt[p]])
            if R == 1 or (caps[0] >= x > caps[1]):
                c, w = table.setdefault((0, x), cost(0, x))
                acc[0] += c
                warm[0] = max(warm[0], w)
                res[0].append(srt[p])
                forced.add(p)
        gmax = max(a + w for a, w in zip(acc, warm))
        for p in idx:
            if p in forced:
                continue
            x = int(lengths[srt[p]])
            sel, low = -1, math.inf
            for k in range(R):
                if caps[k] < x:
                    continue
                c, w = table.setdefault((k, x), cost(k, x))
                cand = max(gmax, acc[k] + c + max(warm[k], w))
                if cand < low:
                    low, sel = cand, k
                if cand == low and acc[k] == 0:
                    sel = k
            c, w = table[(sel, x)]
            acc[sel] += c
            warm[sel] = max(warm[sel], w)
            gmax = max(gmax, acc[sel] + warm[sel])
            res[sel].append(srt[p])
        if gmax < best:
            best, best_res = gmax, res
        if any(not g for g in best_res):
            return AuthorsResult([[] for _ in range(R)], math.inf, False)
    assign: list = [[] for _ in range(R)]
    for k, r in enumerate(order):
        assign[r] = sorted(best_res[k])
    return AuthorsResult(assign, best, True)


def makespan(lengths: Sequence[int], replicas: Sequence[ReplicaCost], assign: Sequence[Sequence[int]],
             includes_c: bool) -> float:
    """The dispatch objective ``max_r (acc_r + warm_r)`` recomputed from an assignment."""
    out = 0.0
    for r, a in zip(replicas, assign):
        cost = [r.seq_cost(lengths[i]) + (r.c * lengths[i] / r.cap if includes_c else 0.0) for i in a]
        warm = [(r.seq_cost(lengths[i]) + (r.c if includes_c else 0.0)) * (r.pp - 1) for i in a]
        out = max(out, sum(cost) + max(warm))
    return out


# (name, workload, hardware, lists; the first list is the homogeneous optimizer layout)
CASES = (
    ("32b@64 train_hetu_tencent", "hydraulis_32b_64gpu_cc", "a800-80g-megatron",
     ["(16,1)x4", "(16,1) + (8,1)x6", "(16,1) + (4,1)x12", "(8,3) + (4,1)x10", "(8,1) + (4,1)x14", "(4,2)x8"]),
    ("13b@32 gh scripts", "hydraulis_13b_32gpu_gh", "a800-80g-megatron", ["(16,1)x2", "(16,1) + (2,2) + (1,4)x3"]),
    # the 7B lists as measured when the refinement was added (then (1,8) had no 80 GB price: its A100 companion list instead)
    ("7b@16 cc scripts", "hydraulis_7b_16gpu_cc", "a800-80g-megatron", ["(4,2)x2", "(4,2) + (1,4)x2"]),
    ("7b@16 gh scripts", "hydraulis_7b_16gpu_gh", "a800-80g-megatron", ["(4,2)x2", "(4,2) + (1,4)x2"]),
    ("7b@16 A100 test lists", "hydraulis_7b_16gpu_a100_cc", "a100-40g-megatron",
     ["(8,1)x2", "(4,2)x2", "(4,2) + (1,8)", "(4,2) + (1,4)x2"]),
    ("32b@1024 test_planner", "hydraulis_32b_1024gpu_cc", "a800-80g-megatron",
     ["(16,1)x64", "(16,1) + (8,1)x3 + (4,1)x238 + (4,4)x2"]),
)


@dataclass(frozen=True)
class Case:
    name: str
    step: int
    list_index: int
    lengths: list
    replicas: list


def planning_cases(steps: int = 4, names: Optional[Sequence[str]] = None, seed: int = 0,
                   token_budget: Optional[int] = None) -> Iterator[Case]:
    """Each (case, step, candidate list) whose largest replica holds the step's longest sequence."""
    from omegaconf import OmegaConf

    from impl.common.hardware import load_hardware
    from impl.common.workloads.varlen import VarlenWorkload

    from impl.hydraulis.batches import step_batches
    from impl.hydraulis.cost.strategy import OptLayout, load_cost_data
    from impl.hydraulis.sim import SimEnv, build_pool, cost_spec, parse_pool
    from impl.hydraulis.system import Hydraulis

    for name, workload, hardware, lists in CASES:
        if names is not None and name not in names:
            continue
        d = OmegaConf.load(f"conf/workload/{workload}.yaml")
        wl = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(VarlenWorkload), d))
        wl = dataclasses.replace(wl, steps=steps, **({"token_budget": token_budget} if token_budget else {}))
        system = Hydraulis(Hydraulis.Config(pool=list(lists)), "hydraulis")
        env = SimEnv(wl, load_hardware(hardware), system, cost_spec(system), load_cost_data())
        first = parse_pool(lists[:1], wl.num_gpus)[0]
        pool, _, _ = build_pool(env, step_batches(wl, seed + 1, 1), OptLayout(len(first), *first[0]))
        for s, b in enumerate(step_batches(wl, seed, steps)):
            ls = b.lengths.tolist()
            for li, cand in enumerate(pool.candidates):
                if max(r.cap for r in cand) >= max(ls):
                    yield Case(name, s, li, ls, list(cand))


def compare(cases: Sequence[Case], includes_c: bool, **ours) -> list[dict]:
    """Per case: ours and theirs on one objective (both recomputed from the assignments)."""
    from impl.hydraulis.dispatch import dispatch

    rows = []
    for c in cases:
        t0 = time.perf_counter()
        d = dispatch(c.lengths, c.replicas, includes_c=includes_c, **ours)
        t1 = time.perf_counter()
        a = authors_dispatch(c.lengths, c.replicas, includes_c=includes_c)
        t2 = time.perf_counter()
        mine = makespan(c.lengths, c.replicas, d.assign, includes_c) if d.feasible else math.inf
        theirs = makespan(c.lengths, c.replicas, a.assign, includes_c) if a.feasible else math.inf
        rows.append(dict(case=c.name, step=c.step, list=c.list_index, replicas=len(c.replicas), ours=mine,
                         theirs=theirs, ratio=(mine / theirs if math.isfinite(theirs) and theirs > 0 else math.nan),
                         ours_s=t1 - t0, theirs_s=t2 - t1, evals=getattr(d, "evals", 0), winner=d.shuffle))
    return rows


def summarize(rows: Sequence[dict]) -> str:
    out = []
    by: dict = {}
    for r in rows:
        by.setdefault(r["case"], []).append(r)
    for name, rs in list(by.items()) + [("all", list(rows))]:
        fin = [r for r in rs if math.isfinite(r["ratio"])]
        worse = [r for r in fin if r["ours"] > r["theirs"]]
        better = [r for r in fin if r["ours"] < r["theirs"]]
        inf_mismatch = sum(1 for r in rs if math.isfinite(r["ours"]) != math.isfinite(r["theirs"]))
        worst = max((r["ratio"] for r in fin), default=math.nan)
        best = min((r["ratio"] for r in fin), default=math.nan)
        mean = sum(r["ratio"] for r in fin) / len(fin) if fin else math.nan
        t_o = sum(r["ours_s"] for r in rs)
        t_t = sum(r["theirs_s"] for r in rs)
        out.append(f"{name:28s} n={len(rs):3d} worse={len(worse):3d} better={len(better):3d} "
                   f"feasibility-differs={inf_mismatch} ours/theirs worst={worst:.4f} mean={mean:.4f} best={best:.4f} "
                   f"time ours {t_o:.2f}s theirs {t_t:.2f}s")
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--cases", nargs="*", default=None, help="case names (default: all but the 1,024-GPU one)")
    p.add_argument("--includes-c", choices=("false", "true", "both"), default="both")
    p.add_argument("--refine", choices=("false", "true"), default="true")
    p.add_argument("--budget", type=int, nargs="*", default=None,
                   help="dispatch_budget, one or more (default: the dispatch default)")
    a = p.parse_args(argv)
    names = a.cases if a.cases else [c[0] for c in CASES if "1024" not in c[0]]
    cases = list(planning_cases(a.steps, names))
    for budget in a.budget if a.budget else [None]:
        kw: dict = {"refine": a.refine == "true"}
        if budget is not None:
            kw["budget"] = budget
        for inc in ((False, True) if a.includes_c == "both" else (a.includes_c == "true",)):
            rows = compare(cases, inc, **kw)
            print(f"# includes_c={inc} refine={kw['refine']} budget={kw.get('budget', 'default')}")
            print(summarize(rows))


if __name__ == "__main__":
    main()
