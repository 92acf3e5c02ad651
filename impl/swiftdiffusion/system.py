"""SwiftDiffusion (Katz) and its baselines as harness systems (one class, the variant is a knob).

| system                   | real mode (2-core CPU, tiny random models)          | sim mode (H800 profile)       |
|--------------------------|-----------------------------------------------------|-------------------------------|
| swiftdiffusion           | README real experiments A-D (controls in the job)   | E1 latency table, E2 16 GPUs  |
| swiftdiffusion_diffusers | -                                                   | Diffusers replicas alone      |
| swiftdiffusion_nirvana*  | ``quality``: img2img from a cached similar result   | Diffusers skipping K steps    |
| swiftdiffusion_nolora    | ``quality``: the pristine model, LoRAs dropped      | Katz without LoRA loads       |
| swiftdiffusion_distrifusion | -                                                | E1: patch-parallel steps      |

Real scenarios (``workload.scenario``): ``controlnet`` (ControlNet service vs one-process
diffusers loop), ``bal`` (BAL per K vs synchronous merge vs the Diffusers pipeline API and the model-level
load+fuse), ``cfg``
(latent parallelism vs batch-2 CFG), ``lora_api`` (diffusers LoRA API costs vs direct merge),
``quality`` (latents of patch-at-K, Nirvana-K and NoLoRA against the synchronous-merge reference).
Every record carries ``latency_s`` (mean per request of the system's own path) and
``throughput_rps``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from impl.common.api import ConfigError, JobContext, RunResult, System

from impl.swiftdiffusion.aggregation import Aggregation
from impl.swiftdiffusion.profile import SimProfile
from impl.swiftdiffusion.variants import BASELINE_SCENARIOS, VARIANTS

NIRVANA_STEPS = 50  # the artifact's K counts steps of 50: strength = 1 - K/50

SCENARIOS = ("controlnet", "bal", "cfg", "lora_api", "quality")
SIM_SCENARIOS = ("e1", "e2", "e3", "e4")


class SwiftDiffusionSystem(System):
    @dataclass
    class Config:
        variant: str = "katz"
        aggregation: Aggregation = Aggregation.sum
        k: int = 20  # BAL patch bound (sim; real mode sweeps workload.k_grid)
        cn_cache: int = 2  # real: ControlNets per server process
        sim_cn_cache: int = 16  # sim: ControlNets per pool GPU ([R] 80 GB / ~2.5 GB, room kept)
        lora_cache: int = 4  # sim: LoRAs in a base replica's host cache (Katz) / loaded (Diffusers)
        diffusers_cn_cache: int = 2  # sim E2 (README.md)
        diffusers_lora_cache: int = 4
        base_replicas: int = 0  # sim E2: 2-GPU base replicas; 0 = the best split of the GPUs
        slo_factor: float = 1.5  # E2: p99 SLO = factor x Diffusers' unloaded p99 (when sim.p99_slo_s = 0)
        # Nirvana-like approximate caching: img2img from a cached similar result, strength 1 - K/50
        nirvana_k: int = 10
        nirvana_hit_rate: float = 1.0  # [R] sim E2: share of prompts with a similar cached result
        # Backbone flags (config flags of the authors' code): CPU has none of the CUDA paths; recorded,
        # not applied.
        cuda_graphs: bool = False
        channels_last: bool = False
        profile: SimProfile = field(default_factory=SimProfile)
        plots: bool = True

        def __post_init__(self):
            VARIANTS.get(self.variant)
            from impl.swiftdiffusion.denoise import AGGREGATIONS

            if self.aggregation not in AGGREGATIONS:
                raise ConfigError(f"system.aggregation: unknown value {self.aggregation!r} (one of: {', '.join(AGGREGATIONS)})")
            if self.k < 0:
                raise ConfigError(f"system.k (patch step bound K) must be >= 0, got {self.k}")
            if self.nirvana_k < 0:
                raise ConfigError(f"system.nirvana_k (steps skipped) must be >= 0, got {self.nirvana_k}")
            if not 0.0 <= self.nirvana_hit_rate <= 1.0:
                raise ConfigError(f"system.nirvana_hit_rate must be in [0, 1], got {self.nirvana_hit_rate}")
            for f in ("cn_cache", "sim_cn_cache", "lora_cache", "diffusers_cn_cache", "diffusers_lora_cache", "base_replicas"):
                if getattr(self, f) < 0:
                    raise ConfigError(f"system.{f} must be >= 0, got {getattr(self, f)}")
            if not self.slo_factor > 0:
                raise ConfigError(f"system.slo_factor must be > 0, got {self.slo_factor}")
            if not isinstance(self.profile, SimProfile):
                self.profile = SimProfile(**dataclasses.asdict(self.profile)) if dataclasses.is_dataclass(self.profile) \
                    else SimProfile(**dict(self.profile))
            self.profile.validate()

    def check(self, mode, workload, hardware, fault) -> None:
        kind = getattr(workload, "kind", None)
        if kind != "diffusion_serving":
            raise ConfigError(f"workload.kind: {self.name} needs a 'diffusion_serving' workload, got {kind!r}")
        if mode == "sim":
            if workload.sim.scenario not in SIM_SCENARIOS:
                raise ConfigError(f"workload.sim.scenario: unknown value {workload.sim.scenario!r} "
                                  f"(one of: {', '.join(SIM_SCENARIOS)})")
            if self.cfg.k >= self.cfg.profile.steps:
                raise ConfigError(f"system.k (patch step bound K) must be < system.profile.steps = "
                                  f"{self.cfg.profile.steps}, got {self.cfg.k}")
            variant = VARIANTS.get(self.cfg.variant)
            if variant.e1_only and workload.sim.scenario != "e1":
                raise ConfigError(f"system.variant: {self.cfg.variant} is modelled for E1 only (its GPU count is not in "
                                  f"the sources), got workload.sim.scenario={workload.sim.scenario}")
            if workload.sim.scenario == "e3" and not variant.sweeps:
                raise ConfigError(f"system.variant: E3 sweeps Katz (system=swiftdiffusion/swiftdiffusion), got {self.cfg.variant!r}")
            if self.cfg.nirvana_k >= self.cfg.profile.steps:
                raise ConfigError(f"system.nirvana_k (steps skipped) must be < system.profile.steps = "
                                  f"{self.cfg.profile.steps}, got {self.cfg.nirvana_k}")
            return
        if workload.scenario not in SCENARIOS:
            raise ConfigError(f"workload.scenario: unknown value {workload.scenario!r} (one of: {', '.join(SCENARIOS)})")
        variant = VARIANTS.get(self.cfg.variant)
        if not variant.runs_all_real and (variant.quality_path is None or workload.scenario not in BASELINE_SCENARIOS):
            raise ConfigError(f"system.variant: {self.cfg.variant} runs real scenario(s) {', '.join(BASELINE_SCENARIOS)} "
                              f"only (sim otherwise; real '{workload.scenario}' runs its controls in the swiftdiffusion job)")
        for k in [self.cfg.nirvana_k, *workload.nirvana_k_grid]:
            if not 0 <= k < NIRVANA_STEPS:
                raise ConfigError(f"system.nirvana_k / workload.nirvana_k_grid (steps skipped of {NIRVANA_STEPS}) "
                                  f"must be in 0..{NIRVANA_STEPS - 1}, got {k}")
        if workload.nirvana_prompt_noise < 0:
            raise ConfigError(f"workload.nirvana_prompt_noise must be >= 0, got {workload.nirvana_prompt_noise}")
        if workload.requests < 1:
            raise ConfigError(f"workload.requests must be >= 1, got {workload.requests}")
        if not workload.remote_bw_bytes_per_s > 0:
            raise ConfigError(f"workload.remote_bw_bytes_per_s must be > 0, got {workload.remote_bw_bytes_per_s}")
        if workload.remote_latency_s < 0 or workload.time_scale < 0:
            raise ConfigError(f"workload.remote_latency_s ({workload.remote_latency_s}) and workload.time_scale "
                              f"({workload.time_scale}) must be >= 0")
        from impl.swiftdiffusion.bal import check_k
        from impl.swiftdiffusion.denoise import check_guidance

        for k in workload.k_grid:
            check_k(k, workload.num_steps)
        check_guidance(workload.control_guidance_start, workload.control_guidance_end)
        if workload.scenario == "controlnet" and not 1 <= workload.num_controlnets <= workload.num_controlnets_built:
            raise ConfigError(f"workload.num_controlnets must be in 1..{workload.num_controlnets_built} "
                              f"(num_controlnets_built), got {workload.num_controlnets}")
        if workload.scenario == "bal" and not 0 <= workload.num_controlnets <= workload.num_controlnets_built:
            raise ConfigError(f"workload.num_controlnets must be in 0..{workload.num_controlnets_built} "
                              f"(num_controlnets_built), got {workload.num_controlnets}")
        if len(workload.cn_scales) < workload.num_controlnets:
            raise ConfigError(f"workload.cn_scales: {len(workload.cn_scales)} scales for "
                              f"{workload.num_controlnets} ControlNets")
        if workload.cond_size:
            f = 2 ** (len(workload.cond_channels) - 1)
            if workload.cond_size != workload.unet.sample_size * f:
                raise ConfigError(f"workload.cond_size: ControlNet conditioning of side {workload.cond_size}, the "
                                  f"ControlNet needs {workload.unet.sample_size * f} (latent "
                                  f"{workload.unet.sample_size} x {f})")
        if any(r < 1 for r in workload.lora_ranks):
            raise ConfigError(f"workload.lora_ranks: every rank must be >= 1, got {list(workload.lora_ranks)}")

    def run(self, job: JobContext) -> RunResult:
        if job.mode == "sim":
            from impl.swiftdiffusion.sim.run import run_sim

            return run_sim(self, job)
        from impl.swiftdiffusion.real import run_real

        return run_real(self, job)
