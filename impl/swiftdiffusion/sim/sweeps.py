"""Sim sweeps (README.md, E3 and E4): E3 sensitivity of Katz on 16 GPUs (BAL bound K, remote LoRA
bandwidth, ControlNet cache per pool GPU, ControlNet:base GPU split) and E4 cache size vs add-on
switches per request (LRU/LFU over the request stream, as the trace study's scripts do).

E3 measures each point as E2 does: throughput at the p99 SLO (E2's SLO, from Diffusers at the
default profile) plus the unloaded mean latency (requests far apart: no queueing). The split
is fixed at ``system.base_replicas`` (0 = E2's best split at the defaults)."""
from __future__ import annotations

import dataclasses

import numpy as np

from impl.common.api import ConfigError, Metric, RunResult

from impl.swiftdiffusion.cache import LFUCache, LRUCache
from impl.swiftdiffusion.sim.serving import max_rate_at_slo, scale_arrivals, simulate_diffusers
from impl.swiftdiffusion.sim.common import _plt, best_split, diffusers_slo, katz_runner, trace_for
from impl.swiftdiffusion.variants import VARIANTS

POLICIES = {"lru": LRUCache, "lfu": LFUCache}


def _unloaded_mean(run, reqs, base_rate) -> float:
    return run(scale_arrivals(reqs, base_rate * 1e-3, base_rate)).mean()


def e3(system, job) -> RunResult:
    cfg, p, sim = system.cfg, system.cfg.profile, job.workload.sim
    if not VARIANTS.get(cfg.variant).sweeps:
        raise ConfigError(f"system.variant: E3 sweeps Katz; got {cfg.variant!r}")
    reqs, base_rate = trace_for(job)
    gpus = sim.gpus
    slo = diffusers_slo(system, job, reqs, base_rate)
    m = {"p99_slo_s": Metric.scalar(slo, "s")}
    # ControlNet:base split (every split, as E2 searches it)
    best, per_split = best_split(system, reqs, base_rate, slo, gpus,
                                 splits=range(1, gpus // 2 + 1))
    b = cfg.base_replicas or best[2]
    pool = gpus - 2 * b
    if pool < 0:
        raise ConfigError(f"system.base_replicas: {b} x 2 GPUs exceed workload.sim.gpus = {gpus}")
    for bb, r in per_split.items():
        m[f"split_b{bb}_rps"] = Metric.scalar(r, "req/s", "higher")
    curves = {"split": [(bb, r) for bb, r in per_split.items()]}

    def point(run):
        return max_rate_at_slo(run, reqs, base_rate, slo)[0], _unloaded_mean(run, reqs, base_rate)

    curves["k"] = []
    for k in sim.k_grid:
        if not 0 <= k < p.steps:
            raise ConfigError(f"workload.sim.k_grid: K must be in 0..{p.steps - 1}, got {k}")
        r, lat = point(katz_runner(cfg, p, b, pool, k=k))
        m[f"k{k}_rps"] = Metric.scalar(r, "req/s", "higher")
        m[f"k{k}_unloaded_mean_s"] = Metric.scalar(lat, "s")
        curves["k"].append((k, r, lat))
    curves["bw"] = []
    for bw in sim.remote_bw_grid:
        if not bw > 0:
            raise ConfigError(f"workload.sim.remote_bw_grid: bandwidth must be > 0, got {bw}")
        q = dataclasses.replace(p, remote_bw_bytes_per_s=bw)
        r, lat = point(katz_runner(cfg, q, b, pool))

        def diff(x, q=q):
            return simulate_diffusers(x, q, gpus, cfg.diffusers_cn_cache, cfg.diffusers_lora_cache)

        r_d = max_rate_at_slo(diff, reqs, base_rate, slo)[0]
        tag = f"{bw / 1e9:g}GBps"
        m[f"bw{tag}_katz_rps"] = Metric.scalar(r, "req/s", "higher")
        m[f"bw{tag}_diffusers_rps"] = Metric.scalar(r_d, "req/s", "higher")
        m[f"bw{tag}_katz_unloaded_mean_s"] = Metric.scalar(lat, "s")
        curves["bw"].append((bw, r, r_d, lat))
    curves["cn_cache"] = []
    slots = max(1, int(p.katz_step_s / p.cn_branch_step_s + 1e-9))
    for c in sim.cn_cache_grid:
        if c < slots:  # a server needs one cached model per busy branch slot
            raise ConfigError(f"workload.sim.cn_cache_grid: {c} < the {slots} branch slots per ControlNet GPU")
        r, lat = point(katz_runner(cfg, p, b, pool, cn_cache=c))
        m[f"cn_cache{c}_rps"] = Metric.scalar(r, "req/s", "higher")
        curves["cn_cache"].append((c, r))
    own = katz_runner(cfg, p, b, pool)
    r_own, res_own = max_rate_at_slo(own, reqs, base_rate, slo)
    m["throughput_rps"] = Metric.scalar(r_own, "req/s", "higher")
    m["latency_s"] = Metric.scalar(res_own.mean(), "s")
    m["base_replicas"] = Metric.scalar(b, "replicas")
    arts = []
    if cfg.plots:
        arts.append(_plot_e3(curves, b, pool, job.out_dir / "e3_sensitivity.png"))
    return RunResult(m, artifacts=arts, info={"requests": len(reqs), "gpus": gpus, "split": f"{b}x2 base + {pool} pool"})


def switches(reqs, policy: str, size: int, kind: str) -> float:
    """Add-on loads (cache misses) per request through one cache of ``size`` over the stream."""
    cache = POLICIES[policy](size, f"workload.sim.cache_sizes ({kind})")
    loads = 0
    for r in reqs:
        ids = r.controlnets if kind == "controlnet" else r.loras
        for a in ids:
            if a not in cache:
                loads += 1
            cache.get(a, lambda: True)
            assert len(cache) <= size
    return loads / len(reqs)


def e4(system, job) -> RunResult:
    sim = job.workload.sim
    reqs, _ = trace_for(job)
    if any(c < 1 for c in sim.cache_sizes):
        raise ConfigError(f"workload.sim.cache_sizes: every size must be >= 1, got {list(sim.cache_sizes)}")
    m, curves = {}, {}
    for kind in ("controlnet", "lora"):
        per_req = float(np.mean([len(r.controlnets if kind == "controlnet" else r.loras) for r in reqs]))
        m[f"{kind}s_per_request"] = Metric.scalar(per_req, "add-ons")
        for pol in POLICIES:
            ys = []
            for c in sim.cache_sizes:
                s = switches(reqs, pol, c, kind)
                m[f"{kind}_{pol}_c{c}_switches"] = Metric.scalar(s, "loads/req")
                ys.append(s)
            curves[(kind, pol)] = ys
    arts = []
    if system.cfg.plots:
        arts.append(_plot_e4(curves, list(sim.cache_sizes), job.out_dir / "e4_cache.png"))
    return RunResult(m, artifacts=arts, info={"requests": len(reqs), "analysis": "trace replay through one cache "
                                              "per add-on kind; no timing (no latency_s/throughput_rps)"})


def _plot_e3(curves, b, pool, path):
    from impl.common.plots.save import save_png

    plt = _plt()
    fig, ax = plt.subplots(2, 2, figsize=(9, 6))
    a = ax[0, 0]
    a.plot([x[0] for x in curves["k"]], [x[1] for x in curves["k"]], marker="o", label="throughput at SLO")
    a.set_xlabel("BAL bound K (steps of 50)")
    a.set_ylabel("req/s")
    a2 = a.twinx()
    a2.plot([x[0] for x in curves["k"]], [x[2] for x in curves["k"]], marker="s", c="C1", label="unloaded mean")
    a2.set_ylabel("unloaded mean latency (s)", color="C1")
    a.set_title("K")
    a = ax[0, 1]
    bws = [x[0] / 1e9 for x in curves["bw"]]
    a.plot(bws, [x[1] for x in curves["bw"]], marker="o", label="Katz")
    a.plot(bws, [x[2] for x in curves["bw"]], marker="o", label="Diffusers")
    a.set_xscale("log")
    a.set_xlabel("remote LoRA store bandwidth (GB/s)")
    a.set_ylabel("req/s at SLO")
    a.set_title("remote bandwidth")
    a.legend(fontsize=7)
    a = ax[1, 0]
    a.plot([x[0] for x in curves["cn_cache"]], [x[1] for x in curves["cn_cache"]], marker="o")
    a.set_xlabel("ControlNets cached per pool GPU")
    a.set_ylabel("req/s at SLO")
    a.set_title("ControlNet cache")
    a = ax[1, 1]
    a.plot([x[0] for x in curves["split"]], [x[1] for x in curves["split"]], marker="o")
    a.set_xlabel("2-GPU base replicas (rest = ControlNet pool, 16 GPUs)")
    a.set_ylabel("req/s at SLO")
    a.set_title("ControlNet:base split")
    fig.suptitle(f"E3: Katz sensitivity, 16 GPUs, split {b}x2 + {pool} (sim)")
    fig.tight_layout()
    return str(save_png(fig, path))


def _plot_e4(curves, sizes, path):
    from impl.common.plots.save import save_png

    plt = _plt()
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    for i, kind in enumerate(("controlnet", "lora")):
        for pol in POLICIES:
            ax[i].plot(sizes, curves[(kind, pol)], marker="o", label=pol.upper())
        ax[i].set_xlabel("cache size (models)")
        ax[i].set_ylabel("loads per request")
        ax[i].set_title(f"{'ControlNet' if kind == 'controlnet' else 'LoRA'} switches")
        ax[i].legend()
    fig.suptitle("E4: cache size vs add-on switches per request (trace replay)")
    fig.tight_layout()
    return str(save_png(fig, path))
