"""FISEdit and its speed references as harness systems (one class, the variant is a knob).

| system          | what runs                                                                  |
|-----------------|----------------------------------------------------------------------------|
| fisedit         | cached sparse edit (schedule: supplied | online), dense_edit and            |
|                 | diffusers_dense interleaved in the same job as controls                    |
| dense_edit      | the same engine (wrappers installed, pass-through), edited prompt, dense   |
| diffusers_dense | stock ``StableDiffusionPipeline`` regenerating with the edited prompt      |

Records keep the numbers apart (`impl/fisedit/README.md`, same heading): ``sparse_step_speedup``
(sparse-phase step against a dense step of the same model, interleaved pairs),
``e2e_speedup_vs_dense_edit``, ``e2e_speedup_vs_diffusers_dense``, each next to its theoretical cap,
and the fidelity figures (``psnr_outside_db`` etc.).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import List

from impl.common.api import ConfigError, JobContext, RunResult, System

from impl.fisedit.cost import SIM_ENGINES
from impl.fisedit.schedules import EDIT_SCHEDULES

VARIANTS = ("fisedit", "dense_edit", "diffusers_dense")
class EditSchedule(enum.StrEnum):
    """FISEdit's two schedules: the edit mask supplied up front, or found online after k dense steps."""

    supplied = "supplied"
    online = "online"


class MaskMethod(enum.StrEnum):
    """How the online schedule turns the latent difference into a mask (impl/fisedit/mask.py)."""

    otsu = "otsu"
    offline = "offline"


ENGINES = ("fast", "reference")
CACHE_DEVICES = ("auto", "host", "device")
CUDA_GRAPH = ("auto", "off")


class FISEditSystem(System):
    @dataclass
    class Config:
        variant: str = "fisedit"
        schedule: EditSchedule = EditSchedule.supplied
        # k: dense steps that capture the mask (online) / dense tail (supplied); 0 = N/5 (10 of 50)
        mask_steps: int = 0
        mask_method: MaskMethod = MaskMethod.otsu
        block: int = 2  # output block side of the sparse conv (paper: 2x2)
        approx_groupnorm: bool = True  # cached scale/shift (paper); false = exact statistics
        radical_attn: bool = False
        # cells thresholds; 0 = scaled from 576/576/2304 of a 96^2 latent: (H/4)^2, (H/4)^2, (H/2)^2
        conv_min_cells: int = 0
        linear_min_cells: int = 0
        attn_min_cells: int = 0
        dense_fallback_ratio: float = 0.5
        cache_budget_bytes: float = 0.0  # 0 = unlimited host memory
        # real mode: which sparse engine runs (fast = indices once per edit, no host sync in a
        # step, persistent buffers, GroupNorm+SiLU folded into the gathers; reference = the
        # first CPU engine, kept to check the fast one against)
        engine: str = "fast"
        # fast engine: where the cache lives; auto = on the job's device on CUDA (if it fits),
        # in host memory on a CPU job; host = host memory on any device (an H2D copy per op and step)
        cache_device: str = "auto"
        # auto = capture the steady-state UNet step in a CUDA graph on CUDA (the sparse step and
        # the dense baselines alike), eager on the CPU; off = eager everywhere
        cuda_graph: str = "auto"
        # fast engine: an op whose active tiles (with the block rounding) cover at least this share
        # of its map runs dense; 1.0 = only when they cover all of it. 0.5: on this 2-core CPU a
        # 2x2-tile conv breaks even with its dense form at 0.39-0.53 (128 ch, 48^2) and 0.44-0.56
        # (256 ch, 24^2) coverage (impl/fisedit/README.md)
        dense_tile_fraction: float = 0.5
        # real-mode extras (fisedit variant)
        controls: bool = True  # time dense_edit and diffusers_dense interleaved in this job
        profile_layers: bool = True
        block_sweep: List[int] = field(default_factory=lambda: [1, 2, 4, 8])
        # sim-mode
        include_engine_gain: bool = True  # F2's headline figure includes the dense-engine gain
        pcie_efficiency: float = 0.7  # achieved / datasheet host link ([R] A100 ~22, TITAN ~11 GB/s: README)
        # sim: dtype of the cached activations; auto = the compute dtype (workload.sim.dtype): the
        # cache holds the ops' own outputs (the authors' code runs fp32: README, "Cache dtype")
        cache_dtype: str = "auto"
        # sim: true = the cache's H2D is hidden (GPU-resident / fully overlapped prefetch), the
        # headline; false = host cache over PCIe at cache_dtype, excess H2D exposed. Both reported.
        cache_on_gpu: bool = True
        # sim: which engine's sparse step is priced: fused = the paper's (GroupNorm fused into the
        # sparse conv, the headline); reference = this repo's CPU engine (GroupNorm, activations
        # and each sparse conv's pad/clone over the full map), the engine the fidelity job measures
        sim_engine: str = "fused"

        def __post_init__(self):
            if self.variant not in VARIANTS:
                raise ConfigError(f"system.variant: unknown value {self.variant!r} (one of: {', '.join(VARIANTS)})")
            EDIT_SCHEDULES.get(self.schedule)
            if self.mask_method not in ("otsu", "offline"):
                raise ConfigError(f"system.mask_method: unknown value {self.mask_method!r} (one of: otsu, offline)")
            if self.sim_engine not in SIM_ENGINES:
                raise ConfigError(f"system.sim_engine: unknown value {self.sim_engine!r} (one of: {', '.join(SIM_ENGINES)})")
            if self.block < 1:
                raise ConfigError(f"system.block must be >= 1, got {self.block}")
            if not 0.0 < self.dense_fallback_ratio <= 1.0:
                raise ConfigError(f"system.dense_fallback_ratio must be in (0, 1], got {self.dense_fallback_ratio}")
            if self.engine not in ENGINES:
                raise ConfigError(f"system.engine: unknown value {self.engine!r} (one of: {', '.join(ENGINES)})")
            if self.cache_device not in CACHE_DEVICES:
                raise ConfigError(f"system.cache_device: unknown value {self.cache_device!r} (one of: {', '.join(CACHE_DEVICES)})")
            if self.cuda_graph not in CUDA_GRAPH:
                raise ConfigError(f"system.cuda_graph: unknown value {self.cuda_graph!r} (one of: {', '.join(CUDA_GRAPH)})")
            if not 0.0 < self.dense_tile_fraction <= 1.0:
                raise ConfigError(f"system.dense_tile_fraction must be in (0, 1], got {self.dense_tile_fraction}")
            if self.cache_dtype not in ("auto", "fp32", "fp16", "bf16"):
                raise ConfigError(f"system.cache_dtype: unknown value {self.cache_dtype!r} (one of: auto, fp32, fp16, bf16)")

    def mask_steps(self, num_steps: int) -> int:
        k = self.cfg.mask_steps or max(1, round(num_steps / 5))
        if not 0 < k < num_steps:
            raise ConfigError(f"system.mask_steps {k} must be in [1, workload.num_steps-1 = {num_steps - 1}]")
        return k

    def run(self, job: JobContext) -> RunResult:
        wl = job.workload
        if getattr(wl, "kind", None) != "diffusion_edit":
            raise ConfigError(f"workload.kind: {self.name} needs a diffusion_edit workload, got {getattr(wl, 'kind', None)!r}")
        if wl.num_steps < 2:
            raise ConfigError(f"workload.num_steps must be >= 2, got {wl.num_steps}")
        if job.mode == "sim":
            from impl.fisedit.sim import run_sim

            return run_sim(self, job)
        from impl.fisedit.real import run_real

        return run_real(self, job)

