"""Why a real ``cpu_joint`` record came out the way it did, from the record alone::

    python -m impl.lobra.diagnose RECORD.json

Rebuilds every round's batch from the record's seed and tasks (the streams are seeded), replans
it with the record's fitted f per replica kind (the plan the run executed), and prints per timed round and policy: each rank's measured compute against the
fits' prediction, each rank's idle share of the step, the padding, and the **cap bound**:
R_L's fitted time for just the sequences longer than R_S's max_tokens, unpadded, each
charged min(t(1, x), ∂t/∂mbs at x): the least a sequence can cost in any micro-batch whatever
the sign of f's fixed part, so batching cannot undercut it. Only R_L can hold those, so no dispatcher and no bucketing can bring LobRA's step
below it; it is set against Task-Fused's planned step on the same batch.
"""
from __future__ import annotations

import json
import statistics
import sys

from impl.common.varlen.lengths import LengthDist
from impl.common.workloads.multitask_lora import MultitaskLoraWorkload, TaskSpec
from impl.common.workloads.varlen import VarlenModelShape

from impl.lobra.joint_step import TaskStreams
from impl.lobra.real import make_job, phases_of, schemes_of
from impl.lobra.system import LobRA


def job_of(rec: dict):
    c = rec["config"]
    w = c["workload"]
    tasks = [TaskSpec(t["name"], LengthDist(**t["lengths"]), t["batch_seqs"]) for t in w["tasks"]]
    wl = MultitaskLoraWorkload(model=VarlenModelShape(**w["model"]), num_gpus=w["num_gpus"], tasks=tasks,
                               steps=w["steps"], warmup_steps=w["warmup_steps"])
    s = c["system"]
    cfg = LobRA.Config(num_buckets=s["num_buckets"], fixed_buckets=list(s["fixed_buckets"]), dispatch=s["dispatch"],
                       exec_mode=s["exec_mode"], ilp_time_limit_s=s["ilp_time_limit_s"], ilp_gap=s["ilp_gap"],
                       bucket_cuts=s.get("bucket_cuts", "off"))  # records before the knob: the plain DP
    for k in ("large_max_tokens", "small_max_tokens", "interleave"):
        setattr(cfg.real, k, s["real"][k])
    caps = rec["info"].get("max_tokens")  # records with the budget rule: the caps it chose
    if caps:
        cfg.real.large_max_tokens, cfg.real.small_max_tokens = caps["R_L"], caps["R_S"]
    return make_job(LobRA(cfg, "lobra"), wl, rec["seed"]), wl


def diagnose(rec: dict) -> list[dict]:
    job, wl = job_of(rec)
    fits = rec["info"]["cost_fit"]
    schemes = schemes_of(job, fits)
    cap = job.max_tokens["R_S"]
    measured = {p: {s["round"]: s for s in steps} for p, steps in rec["info"]["steps"].items()}
    streams = TaskStreams(job.tasks, job.seed)
    rows = []
    for r in range(job.rounds):
        samples = streams.step()
        if r < wl.warmup_steps:
            continue
        planned = {p: phases_of(job, p, samples, schemes, fits)[1] for p in job.policies}
        long_ = [s.length for s in samples if s.length > cap]
        rl = schemes["R_L"]
        bound = sum(min(rl.t(1, x), rl.alpha(x)) for x in long_) if "c" in fits["R_L"] else float("nan")
        tf = max(planned["task_fused"]["predicted_s"]) if "task_fused" in planned else float("nan")
        for p in job.policies:
            m = measured[p].get(r)
            if m is None:
                continue
            comp = [sum(c) for c in m["compute_s"]]
            rows.append({"round": r, "policy": p, "step_s": m["step_s"], "compute_s": comp,
                         "predicted_s": planned[p]["predicted_s"],
                         "idle_frac": [1 - c / m["step_s"] for c in comp], "pad_ratio": m["pad_ratio"],
                         "long_token_frac": sum(long_) / sum(s.length for s in samples),
                         "cap_bound_s": bound, "task_fused_planned_s": tf})
    return rows


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m impl.lobra.diagnose RECORD.json", file=sys.stderr)
        return 2
    rec = json.load(open(argv[0]))
    rows = diagnose(rec)
    cap = (rec["info"].get("max_tokens") or {}).get("R_S", rec["config"]["system"]["real"]["small_max_tokens"])
    fits = rec["info"]["cost_fit"]
    refused = [k for k, f in fits.items() if "c" not in f]
    print(f"R_S max_tokens {cap}; fit R2 {({k: round(f['r2'], 4) for k, f in fits.items() if 'r2' in f})}"
          + (f", REFUSED {refused} (their planned times are meaningless; LobRA dispatched length-based)"
             if refused else "")
          + f"; measured/predicted per micro-batch: {rec['info']['fit_measured_over_predicted']}")
    print("round policy           step_s  compute r0/r1   planned r0/r1   idle r0/r1   pad   "
          f"tokens>{cap}  cap bound / TF planned")
    for x in rows:
        print(f"{x['round']:5d} {x['policy']:16s} {x['step_s']:6.2f}  {x['compute_s'][0]:6.2f}/{x['compute_s'][1]:<6.2f} "
              f"{x['predicted_s'][0]:6.2f}/{x['predicted_s'][1]:<6.2f}  {x['idle_frac'][0]:.2f}/{x['idle_frac'][1]:.2f}"
              f"   {x['pad_ratio']:.3f} {x['long_token_frac']:8.2f}     {x['cap_bound_s']:.2f} / "
              f"{x['task_fused_planned_s']:.2f}")
    lob = [x for x in rows if x["policy"] == "lobra"]
    if lob and "task_fused" in rec["info"]["steps"]:
        print(f"median cap bound / Task-Fused planned step: "
              f"{statistics.median(x['cap_bound_s'] / x['task_fused_planned_s'] for x in lob):.3f} "
              f"(> 1: LobRA cannot beat Task-Fused on these batches, whatever the dispatch)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
