"""Cluster routers (spec caraserve.md 2.5 and 3): rank-aware, MostIdle, Random, FirstFit, and
Punica's "largest batch that still has room". A router is ``route(req, servers, now) -> index``;
ties go to fewer active requests, then the lower server id. All decisions are deterministic for
a seed."""
from __future__ import annotations

import random as _random
from typing import Callable

from impl.common.api import ConfigError

ROUTERS = ("rank_aware", "mostidle", "random", "firstfit", "punica")


def make_router(kind: str, model=None, slo_of: Callable = None, max_batch: int = 32, seed: int = 0,
                penalty_s: float = 1.0):
    if kind not in ROUTERS:
        raise ConfigError(f"system.router: unknown router {kind!r} (one of: {', '.join(ROUTERS)})")
    if kind == "mostidle":
        return lambda q, servers, now: min(range(len(servers)), key=lambda i: (servers[i].active(), i))
    if kind == "random":
        rng = _random.Random(seed)
        return lambda q, servers, now: rng.randrange(len(servers))
    if kind == "firstfit":
        def firstfit(q, servers, now):
            for i, s in enumerate(servers):
                if s.active() < max_batch:
                    return i
            return min(range(len(servers)), key=lambda i: (servers[i].active(), i))
        return firstfit
    if kind == "punica":
        def punica(q, servers, now):
            room = [i for i, s in enumerate(servers) if s.active() < max_batch]
            if not room:
                return min(range(len(servers)), key=lambda i: (servers[i].active(), i))
            return max(room, key=lambda i: (servers[i].active(), -i))
        return punica
    if model is None:
        raise ConfigError("system.router: rank_aware routing needs a fitted cost model")
    model.check()

    a0, a1, a2, a3 = model.dec_coef
    b0, b1, b2 = model.pre_coef
    mb = model.kernel == "mbgmv"

    def slo(r):
        v = r.data.get("slo_s") if isinstance(r.data, dict) else None
        if v is None:
            v = slo_of(r)
            if isinstance(r.data, dict):
                r.data["slo_s"] = v
        return v

    def rank_aware(q, servers, now):
        """Same arithmetic as RankCostModel.decode_s/prefill_s, on running sums (fast path)."""
        best, best_key = 0, None
        q_slo = slo(q)
        for i, s in enumerate(servers):
            queue, batch = s.sched.waiting, s.sched.running
            sL = sLr = 0.0
            B = len(batch) + len(queue)
            ctx = rsum = 0.0
            rmax = 0
            slos = []
            for r in batch:
                ctx += r.prompt_len + r.generated
                rsum += r.rank
                rmax = r.rank if r.rank > rmax else rmax
                slos.append(slo(r))
            for r in queue:
                sL += r.prompt_len
                sLr += r.prompt_len * r.rank
                ctx += r.prompt_len
                rsum += r.rank
                rmax = r.rank if r.rank > rmax else rmax
                slos.append(slo(r))
            pre_old = (b0 + b1 * sL + b2 * sLr) if queue else 0.0
            pre_new = b0 + b1 * (sL + q.prompt_len) + b2 * (sLr + q.prompt_len * q.rank)
            dP = pre_new - pre_old
            t_old = (a0 + a1 * B + a2 * (rsum if mb else B * rmax) + a3 * ctx) if B else 0.0
            rmax2 = max(rmax, q.rank)
            t_new = a0 + a1 * (B + 1) + a2 * ((rsum + q.rank) if mb else (B + 1) * rmax2) + a3 * (ctx + q.prompt_len)
            dD = t_new - t_old
            viol = sum(1 for v in slos if t_new > v) + (1 if t_new > q_slo else 0)
            # spec 2.5: added prefill + added decode time x requests it slows + SLO penalty;
            # [R] the prefill term is the whole prefill q waits for (its own TTFT), so that a
            # server with a queue is not preferred just because its queue already paid the
            # fixed cost, and the prefill stalls every running request once.
            cost = pre_new + dP * len(batch) + dD * (B + 1) + penalty_s * viol
            key = (cost, B, i)
            if best_key is None or key < best_key:
                best, best_key = i, key
        return best

    return rank_aware
