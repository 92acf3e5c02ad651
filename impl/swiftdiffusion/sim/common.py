"""What the SwiftDiffusion sim scenarios share (:mod:`.run`'s E1/E2 and
:mod:`.sweeps`' E3/E4): the trace, the Katz runner at a GPU split, the best split, E2's SLO."""
from __future__ import annotations

from impl.common.api import ConfigError
from impl.common.traces.addons import generate_addon_trace, load_addon_trace

from impl.swiftdiffusion.sim.serving import max_rate_at_slo, scale_arrivals, simulate_diffusers, simulate_katz
from impl.swiftdiffusion.variants import VARIANTS


def trace_for(job):
    """The requests and their base rate (a replayed trace: its own mean rate)."""
    reqs, base_rate = _trace(job)
    if base_rate is None:
        base_rate = len(reqs) / max(reqs[-1].t, 1e-9)
    return reqs, base_rate


def _trace(job):
    t = job.workload.trace
    if t.file:
        return load_addon_trace(t.file), None
    if t.rate_rps <= 0:
        raise ConfigError(f"workload.trace.rate_rps must be > 0, got {t.rate_rps}")
    return generate_addon_trace(t, job.seed), t.rate_rps


def katz_runner(cfg, p, b: int, pool: int, k=None, cn_cache=None):
    """The Katz sim at a split of b base replicas + a pool (the variant nolora drops the LoRAs)."""
    k = cfg.k if k is None else k
    cn_cache = cfg.sim_cn_cache if cn_cache is None else cn_cache

    def katz(q):
        return simulate_katz(q, p, b, pool, k, cn_cache, cfg.lora_cache, drop_loras=VARIANTS.get(cfg.variant).drops_loras)

    return katz


def best_split(system, reqs, base_rate: float, slo: float, gpus: int, p=None, splits=None):
    """Throughput at the SLO per split (b 2-GPU base replicas, the rest ControlNet pool); the best
    as (rate, result, b, runner) and {b: rate}. ``system.base_replicas`` > 0 fixes the split."""
    cfg = system.cfg
    p = cfg.profile if p is None else p
    if splits is None:
        splits = [cfg.base_replicas] if cfg.base_replicas else range(1, gpus // 2 + 1)
    best, per = None, {}
    for b in splits:
        pool = gpus - 2 * b
        if pool < 0:
            raise ConfigError(f"system.base_replicas: {b} x 2 GPUs exceed workload.sim.gpus = {gpus}")
        katz = katz_runner(cfg, p, b, pool)
        try:
            r_k, res_k = max_rate_at_slo(katz, reqs, base_rate, slo)
        except ConfigError:  # the pool cannot hold a request's ControlNets: not a valid split
            continue
        per[b] = r_k
        if best is None or r_k > best[0]:
            best = (r_k, res_k, b, katz)
    if best is None:
        raise ConfigError("system.base_replicas: no split of the GPUs can serve the trace's ControlNets")
    return best, per


def diffusers_slo(system, job, reqs, base_rate) -> float:
    """E2's p99 SLO: workload.sim.p99_slo_s, or slo_factor x Diffusers' unloaded p99."""
    cfg, sim = system.cfg, job.workload.sim
    if sim.p99_slo_s:
        return sim.p99_slo_s
    q = scale_arrivals(reqs, base_rate * 1e-3, base_rate)
    return cfg.slo_factor * simulate_diffusers(q, cfg.profile, sim.gpus, cfg.diffusers_cn_cache,
                                               cfg.diffusers_lora_cache).p99()


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
