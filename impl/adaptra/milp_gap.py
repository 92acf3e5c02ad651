"""S8: ADAPTRA's list scheduler against the MILP optimum (impl/adaptra/README.md), and its CLI.

    python -m impl.adaptra.milp_gap                  # link (0, 1) at 3t, the S8 sizes
    python -m impl.adaptra.milp_gap --link last --memory none

The oracle itself (model, HiGHS solve, exact replay) is :mod:`impl.adaptra.milp`.
"""
from __future__ import annotations

import math
import time
from typing import Optional, Sequence

from impl.adaptra.milp import replay_order, solve_pipeline_milp
from impl.common.api import ConfigError
from impl.common.schedule.list_scheduler import check_vec


def default_delays(num_stages: int, t_op_s: float) -> list[float]:
    """S8's default straggler: link (0, 1) delayed by 3·t, the others clean.

    The first link is the paper's "first link" setting (our S3), and 3t is the point of the
    CPU link-delay experiment's acceptance test [R] where a delay-blind schedule already
    cascades (impl/adaptra/README.md, "Reconstructed choices").
    """
    return [3.0 * t_op_s if i == 0 else 0.0 for i in range(num_stages - 1)]


def scheduler_gap(S: int, N: int, t_op_s: float = 0.01, c: Optional[Sequence[float]] = None,
                  formula: str = "paper", *, memory: str = "quota", steps_per_op: int = 30,
                  time_limit_s: float = 60.0, mip_rel_gap: float = 1e-4, replay: bool = True) -> dict:
    """ADAPTRA's Alg. 2 + Alg. 3/4 schedule versus the MILP optimum (S8).

    Both sides use one semantics: every F/B/W takes ``t_op_s``; a cross-stage dependency over
    link (i, i+1) adds ``c_i``; nothing else costs time (no base comm time, no queueing/HOL).
    ``memory="quota"`` (default) gives the MILP the same activation limit the builder runs
    under (``limit_inflight``: at most ``x_i`` forwards without their B on stage i, x from
    Alg. 2), so it optimises over exactly the schedules the builder could have produced;
    ``"none"`` drops the limit (a lower bound on any schedule, not a like-for-like gap).
    The builder's warm-up rule ("only F until x_i forwards") is its policy, not a constraint,
    so the MILP does not impose it.

    ``builder_s`` is the builder's order replayed exactly under those semantics;
    ``builder_timeline_s`` is the builder's own discretised timeline (equal when every time
    is a multiple of its step δ, as in the default setting); ``sim_s`` replays the order in
    the pipeline simulator (latency comm model, zero base time, delays ``c``).
    ``gap = builder_s / milp_s − 1`` against the MILP incumbent; ``gap_upper`` is against the
    proved bound, so it is the honest figure when ``milp_status`` is not ``"optimal"``.
    """
    from impl.adaptra.adapt import adapt_warmup
    from impl.common.schedule.list_scheduler import build_timeline

    if not isinstance(S, int) or S < 1:
        raise ConfigError(f"S (num_stages) must be an integer >= 1, got {S!r}")
    if not isinstance(N, int) or N < 1:
        raise ConfigError(f"N (num_microbatches) must be an integer >= 1, got {N!r}")
    if not (t_op_s > 0 and math.isfinite(t_op_s)):
        raise ConfigError(f"t_op_s must be finite and > 0, got {t_op_s}")
    if memory not in ("quota", "none"):
        raise ConfigError(f"memory must be 'quota' or 'none', got {memory!r}")
    c = default_delays(S, t_op_s) if c is None else check_vec("c", c, S - 1, positive=False)
    t = [float(t_op_s)] * S

    t0 = time.perf_counter()
    warmup = adapt_warmup(t, t, c, N, formula=formula)
    tl = build_timeline(t, t, t, c, warmup, num_microbatches=N, steps_per_op=steps_per_op,
                        limit_inflight=True)
    build_s = time.perf_counter() - t0
    _, builder_s = replay_order(tl.schedule, t, t, t, c)

    sim_s = None
    if replay:
        from impl.common.cost.comm import LinkCosts
        from impl.common.cost.transformer import StageCosts
        from impl.common.schedule.comm import insert_comm
        from impl.common.sim.pipeline import CommModel, simulate_iteration

        delays = {(i, i + 1): ci for i, ci in enumerate(c) if ci > 0}
        sim_s = simulate_iteration(insert_comm(tl.schedule), StageCosts.uniform(S, t_op_s),
                                   LinkCosts.uniform(S, 0.0), CommModel(kind="latency", queue_depth=None),
                                   delays=delays).iteration_time_s

    res = solve_pipeline_milp(t, t, t, c, N, memory_limit=warmup if memory == "quota" else None,
                              time_limit_s=time_limit_s, mip_rel_gap=mip_rel_gap)
    return {
        "S": S, "N": N, "t_op_s": float(t_op_s), "c": list(c), "formula": formula, "memory": memory,
        "warmup": list(warmup),
        "builder_s": builder_s, "builder_timeline_s": tl.makespan_s, "sim_s": sim_s, "build_time_s": build_s,
        "milp_s": res.makespan_s, "milp_bound_s": res.bound_s,
        "gap": builder_s / res.makespan_s - 1.0, "gap_upper": builder_s / res.bound_s - 1.0,
        "milp_status": res.status, "milp_gap": res.gap, "milp_solver_gap": res.solver_mip_gap,
        "milp_time_s": res.solve_time_s, "milp_binaries": res.num_binaries,
    }


S8_SIZES = ((3, 6), (4, 12), (6, 18), (8, 32))


def _main(argv: Optional[Sequence[str]] = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m impl.adaptra.milp_gap",
                                 description="S8: ADAPTRA's list scheduler vs the MILP optimum.")
    ap.add_argument("--t-op-ms", type=float, default=10.0, help="uniform F/B/W time (ms)")
    ap.add_argument("--delay-ms", type=float, default=None,
                    help="delay on link (0,1) in ms (default 3 x t-op)")
    ap.add_argument("--link", default="0", help="slow link i of (i, i+1), or 'last' (default 0)")
    ap.add_argument("--formula", default="paper", choices=("paper", "artifact"))
    ap.add_argument("--memory", default="quota", choices=("quota", "none"))
    ap.add_argument("--time-limit-s", type=float, default=60.0)
    args = ap.parse_args(argv)
    import highspy

    highspy.Highs()  # HiGHS prints its banner on the first instance: get it out before the table
    t = args.t_op_ms / 1e3
    cd = 3 * t if args.delay_ms is None else args.delay_ms / 1e3
    print(f"t_op = {t * 1e3:g} ms, delay {cd * 1e3:g} ms on link {args.link}, "
          f"formula={args.formula}, MILP memory={args.memory}")
    head = f"{'S':>2} {'N':>3} {'warm-up x':<32} {'builder':>9} {'sim':>9} {'MILP':>9} {'bound':>9} " \
           f"{'gap':>7} {'status':>10} {'solve':>7}"
    print(head)
    for S, N in S8_SIZES:
        link = S - 2 if args.link == "last" else int(args.link)
        if not 0 <= link < S - 1:
            raise ConfigError(f"--link {args.link} is not a link of a {S}-stage pipeline")
        c = [cd if i == link else 0.0 for i in range(S - 1)]
        r = scheduler_gap(S, N, t, c, args.formula, memory=args.memory, time_limit_s=args.time_limit_s)
        sim = "n/a" if r["sim_s"] is None else f"{r['sim_s'] * 1e3:.1f}"
        print(f"{S:>2} {N:>3} {str(r['warmup']):<32} {r['builder_s'] * 1e3:>7.1f}ms {sim:>7}ms "
              f"{r['milp_s'] * 1e3:>7.1f}ms {r['milp_bound_s'] * 1e3:>7.1f}ms {100 * r['gap']:>6.2f}% "
              f"{r['milp_status']:>10} {r['milp_time_s']:>6.2f}s")


if __name__ == "__main__":
    _main()
