"""Cluster routers (CaraServe, arXiv 2401.11240, and its baselines): rank-aware, MostIdle, Random, FirstFit, and
Punica's "largest batch that still has room". A router is ``route(req, servers, now) -> index``;
ties go to fewer active requests, then the lower server id. All decisions are deterministic for
a seed."""
from __future__ import annotations

import bisect
import random
from dataclasses import dataclass
from typing import Callable

import numpy as np

from impl.common.api import ConfigError
from impl.common.registry import Registry

@dataclass(frozen=True)
class Router:
    """``build(model, slo_of, max_batch, seed, penalty_s)`` makes the route function."""

    build: Callable
    # routes by a cost model fitted before the run (built only when there is more than one server)
    needs_model: bool = False


def _least_active(servers) -> int:
    return min(range(len(servers)), key=lambda i: (servers[i].active(), i))


def _mostidle(model, slo_of, max_batch, seed, penalty_s):
    return lambda q, servers, now: _least_active(servers)


def _random_pick(model, slo_of, max_batch, seed, penalty_s):
    rng = random.Random(seed)
    return lambda q, servers, now: rng.randrange(len(servers))


def _firstfit(model, slo_of, max_batch, seed, penalty_s):
    def firstfit(q, servers, now):
        for i, s in enumerate(servers):
            if s.active() < max_batch:
                return i
        return _least_active(servers)
    return firstfit


def _punica(model, slo_of, max_batch, seed, penalty_s):
    def punica(q, servers, now):
        room = [i for i, s in enumerate(servers) if s.active() < max_batch]
        if not room:
            return _least_active(servers)
        return max(room, key=lambda i: (servers[i].active(), -i))
    return punica


def _rank_aware(model, slo_of, max_batch, seed, penalty_s):
    if model is None:
        raise ConfigError("system.router: rank_aware routing needs a fitted cost model")
    model.check()
    return RankAwareRouter(model, slo_of, penalty_s)


ROUTERS: Registry[Router] = Registry("router", "system.router")
ROUTERS.add("rank_aware", Router(_rank_aware, needs_model=True))
ROUTERS.add("mostidle", Router(_mostidle))
ROUTERS.add("random", Router(_random_pick))
ROUTERS.add("firstfit", Router(_firstfit))
ROUTERS.add("punica", Router(_punica))


def make_router(kind: str, model=None, slo_of: Callable = None, max_batch: int = 32, seed: int = 0,
                penalty_s: float = 1.0):
    return ROUTERS.get(kind).build(model, slo_of, max_batch, seed, penalty_s)


class RankAwareRouter:
    """The rank-aware router (paper; weights [R], impl/caraserve/README.md "Router"), with T_pre and
    T_dec the fitted affine forms of :mod:`impl.caraserve.cost`:

        dP = T_pre(queue + q) - T_pre(queue)          dD = T_dec(batch + q) - T_dec(batch)
        cost = dP + dD * (|batch| + 1) + penalty_s * viol

    T(empty set) is the form at zero features (the intercept a0 / b0), so dP and dD are the
    *marginal* times q adds and the intercepts cancel. (Evaluating T(empty) as 0 instead charges
    an idle server the whole fixed step/weight-read cost, so busy servers look cheaper and the
    router piles requests onto them: S3 SLO 22%.) Here |batch| counts running + queued requests
    (the queue joins the next decode step) and viol counts the requests whose predicted TPOT
    (the decode step with q) exceeds their SLO. Ties: fewer active, then lower id.

    Per-server aggregates are cached by the server's ``version`` (bumped on every state change)
    and the cost is evaluated for all servers at once with numpy; :meth:`reference` is the plain
    per-request loop, and the two make identical decisions (tests/caraserve/test_router.py)."""

    def __init__(self, model, slo_of: Callable, penalty_s: float):
        self.a = [float(x) for x in model.dec_coef]
        self.b = [float(x) for x in model.pre_coef]
        self.mb = model.kernel == "mbgmv"
        self.slo_of = slo_of
        self.penalty_s = float(penalty_s)
        self._cache: dict = {}

    def slo(self, r) -> float:
        v = r.data.get("slo_s") if isinstance(r.data, dict) else None
        if v is None:
            v = self.slo_of(r)
            if isinstance(r.data, dict):
                r.data["slo_s"] = v
        return v

    def _aggregate(self, s):
        """(B, sum ctx, sum r, max r, queued, sum L queued, sum L*r queued, sorted SLOs)."""
        queue, batch = s.sched.waiting, s.sched.running
        B = len(batch) + len(queue)
        ctx = rsum = rmax = sL = sLr = 0
        slos = []
        for r in batch:
            ctx += r.prompt_len + r.generated
            rsum += r.rank
            rmax = r.rank if r.rank > rmax else rmax
            slos.append(self.slo(r))
        for r in queue:
            sL += r.prompt_len
            sLr += r.prompt_len * r.rank
            ctx += r.prompt_len
            rsum += r.rank
            rmax = r.rank if r.rank > rmax else rmax
            slos.append(self.slo(r))
        slos.sort()
        return B, ctx, rsum, rmax, len(queue), sL, sLr, slos

    def _cost_terms(self, q, B, ctx, rsum, rmax, sL, sLr, np_mod):
        """The arithmetic of the cost, shared by the numpy path (arrays) and the reference
        (scalars) so both round identically."""
        a0, a1, a2, a3 = self.a
        b0, b1, b2 = self.b
        pre_old = b0 + b1 * sL + b2 * sLr
        pre_new = b0 + b1 * (sL + q.prompt_len) + b2 * (sLr + q.prompt_len * q.rank)
        dP = pre_new - pre_old
        rmax2 = np_mod.maximum(rmax, q.rank) if np_mod is not None else max(rmax, q.rank)
        lora_old = rsum if self.mb else B * rmax
        lora_new = (rsum + q.rank) if self.mb else (B + 1) * rmax2
        t_old = a0 + a1 * B + a2 * lora_old + a3 * ctx
        t_new = a0 + a1 * (B + 1) + a2 * lora_new + a3 * (ctx + q.prompt_len)
        dD = t_new - t_old
        return dP, dD, t_new

    def __call__(self, q, servers, now) -> int:
        n = len(servers)
        aggs = []
        for i, s in enumerate(servers):
            ver = getattr(s, "version", None)
            hit = self._cache.get(i) if ver is not None else None
            if hit is None or hit[0] is not s or hit[1] != ver:
                hit = (s, ver, self._aggregate(s))
                if ver is not None:
                    self._cache[i] = hit
            aggs.append(hit[2])
        cols = np.array([a[:7] for a in aggs], dtype=np.float64).reshape(n, 7)
        B, ctx, rsum, rmax, _, sL, sLr = (cols[:, k] for k in range(7))
        dP, dD, t_new = self._cost_terms(q, B, ctx, rsum, rmax, sL, sLr, np)
        q_slo = self.slo(q)
        viol = np.array([bisect.bisect_left(a[7], t) + (1 if t > q_slo else 0) for a, t in zip(aggs, t_new.tolist())],
                        dtype=np.float64)
        cost = dP + dD * (B + 1) + self.penalty_s * viol
        return int(np.lexsort((np.arange(n), B, cost))[0])

    def reference(self, q, servers, now) -> int:
        """Plain loop over every server's requests (the specification of :meth:`__call__`)."""
        best, best_key = 0, None
        q_slo = self.slo(q)
        for i, s in enumerate(servers):
            B, ctx, rsum, rmax, _, sL, sLr, slos = self._aggregate(s)
            dP, dD, t_new = self._cost_terms(q, float(B), float(ctx), float(rsum), float(rmax), float(sL),
                                             float(sLr), None)
            viol = sum(1 for v in slos if t_new > v) + (1 if t_new > q_slo else 0)
            cost = dP + dD * (B + 1) + self.penalty_s * viol
            key = (cost, B, i)
            if best_key is None or key < best_key:
                best, best_key = i, key
        return best
