"""Workload for diffusion editing/serving (FISEdit; SwiftDiffusion reuses the model part)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import List, Optional

from impl.common.diffusion.pipelines import UNetShape
from impl.common.host_alloc import check_host_malloc


class EditSimScenario(enum.StrEnum):
    """FISEdit's paper-scale sim scenarios F1-F4 (impl/fisedit/README.md, "Reconstructed choices")."""

    f1 = "f1"
    f2 = "f2"
    f3 = "f3"
    f4 = "f4"


class MaskShape(enum.StrEnum):
    """The synthetic edit mask: one rectangle, or a smooth random blob (impl/fisedit/mask.py)."""

    rect = "rect"
    blob = "blob"


@dataclass
class EditSimSpec:
    """Sim-mode scenario at paper scale (F1-F4 [R], impl/fisedit/README.md)."""

    scenario: EditSimScenario = EditSimScenario.f1
    unet: str = "sd21"  # the UNet the cost model traces (sd21 = SD 2.1 768-v, latent 96)
    dtype: str = "fp16"
    num_steps: int = 50
    mask_steps: int = 10
    batch: int = 2  # CFG
    # F1: the f grid
    f_grid: List[float] = field(default_factory=lambda: [0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5])
    # F2: mask ratios ~ Beta with this mean and 90th percentile, over n_edits edits
    mask_mean: float = 0.15
    mask_p90: float = 0.35
    n_edits: int = 3000
    # Engine (fusion) gain of the paper's dense engine over stock diffusers, applied when
    # include_engine_gain ([R] 1.3-1.6x, impl/fisedit/README.md); both figures are reported anyway.
    engine_gain: float = 1.45
    # F3: host-RAM budgets per cached image, bytes
    host_budgets_bytes: List[float] = field(default_factory=lambda: [0.0, 4e9, 8e9, 16e9, 32e9, 64e9])
    # F4: multi-user server
    users: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    server_host_ram_bytes: float = 256e9
    rounds: int = 5
    launch_overhead_s: float = 5e-6


@dataclass
class DiffusionEditWorkload:
    kind: str = "diffusion_edit"
    unet: UNetShape = field(default_factory=UNetShape)
    scheduler: str = "dpm_multistep"
    num_steps: int = 20
    guidance_scale: float = 7.5
    prompt: str = "a photo of a cat sitting on a red sofa"
    edited_prompt: str = "a photo of a dog sitting on a red sofa"
    # Further serial rounds (edit_session): each edits the previous round's image.
    session_prompts: List[str] = field(default_factory=list)
    # Synthetic mask of this latent ratio (random weights do not localise edits); null = the
    # captured mask.
    mask_ratio: Optional[float] = 0.1
    mask_shape: MaskShape = MaskShape.rect
    # Mask side length override: a mask of another shape is rejected (bad-input check).
    mask_hw: Optional[List[int]] = None
    # Bad-input checks: an edit from another seed / scheduler than the cache was recorded with.
    edit_seed: Optional[int] = None
    edit_scheduler: Optional[str] = None
    repeats: int = 2  # interleaved end-to-end repetitions
    step_repeats: int = 5  # interleaved per-step pairs
    # fp32 | fp16 (CUDA only) | bf16; the device is the job's (execution=auto|cpu|cuda).
    dtype: str = "fp32"
    torch_threads: int = 1
    # Real runs on a host: retain = keep freed memory in the process (glibc mallopt), as CUDA's
    # caching allocator does, so large activations do not page-fault on every call (measured:
    # 8-25k faults per CPU UNet forward, ~9% of it); default = the C library's own behaviour.
    host_malloc: str = "retain"
    sim: EditSimSpec = field(default_factory=EditSimSpec)

    def __post_init__(self) -> None:
        check_host_malloc(self.host_malloc)
