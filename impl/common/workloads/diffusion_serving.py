"""Workload for diffusion serving with ControlNet/LoRA add-ons (SwiftDiffusion / Katz)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import List, Optional

from impl.common.diffusion.pipelines import UNetShape
from impl.common.traces.requests import Arrival


def _tiny_unet() -> UNetShape:
    # SwiftDiffusion's real CPU mode [R]: two resolutions, one cross-attention block.
    return UNetShape(sample_size=32, block_out_channels=[32, 64], layers_per_block=1,
                     down_block_types=["DownBlock2D", "CrossAttnDownBlock2D"],
                     up_block_types=["CrossAttnUpBlock2D", "UpBlock2D"], cross_attention_dim=32,
                     attention_head_dim=8, norm_num_groups=8)


@dataclass
class AddonTraceSpec:
    """SwiftDiffusion's sim request generator ([R] where the sources give no numbers;
    impl/swiftdiffusion/README.md) or a trace file."""

    num_requests: int = 2000
    rate_rps: float = 1.0
    arrival: Arrival = Arrival.poisson
    cv: float = 3.0  # gamma bursts
    service_a_share: float = 0.5
    cn_count_probs: List[float] = field(default_factory=lambda: [0.30, 0.45, 0.20, 0.05])
    lora_count_probs_a: List[float] = field(default_factory=lambda: [0.0, 0.1, 0.9])  # P(0,1,2)
    lora_count_probs_b: List[float] = field(default_factory=lambda: [0.06, 0.74, 0.20])
    controlnets_per_service: int = 50
    hot_cn_share: float = 0.1  # the top 10% of ControlNets ...
    hot_cn_calls: float = 0.95  # ... take 95% of calls
    num_loras: int = 7000
    lora_zipf_alpha: float = 0.9
    file: Optional[str] = None  # a JSON trace with the production trace's fields replaces the generator


class ServingSimScenario(enum.StrEnum):
    """SwiftDiffusion's paper-scale sim scenarios (impl/swiftdiffusion/README.md, "Sim")."""

    e1 = "e1"
    e2 = "e2"
    e3 = "e3"
    e4 = "e4"


class ServingScenario(enum.StrEnum):
    """SwiftDiffusion's real experiments (impl/swiftdiffusion/README.md, "Reconstructed choices")."""

    controlnet = "controlnet"
    bal = "bal"
    cfg = "cfg"
    lora_api = "lora_api"
    quality = "quality"


@dataclass
class AddonSimSpec:
    """Sim scenarios at paper scale (E1-E4, impl/swiftdiffusion/README.md); profile numbers live in
    the system config."""

    scenario: ServingSimScenario = ServingSimScenario.e1
    # E1: add-on configs (ControlNets, LoRAs) of the artifact's table
    configs: List[List[int]] = field(default_factory=lambda: [[0, 0], [0, 1], [1, 0], [1, 1], [2, 2], [3, 0], [3, 2]])
    gpus: int = 16
    rates_rps: List[float] = field(default_factory=lambda: [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0])
    # E2: the p99 both systems must meet; 0 = 2x Diffusers' mean unloaded latency on the mix
    p99_slo_s: float = 0.0
    # E3 sweeps
    k_grid: List[int] = field(default_factory=lambda: [0, 5, 10, 20, 30])
    remote_bw_grid: List[float] = field(default_factory=lambda: [0.1e9, 0.2e9, 0.4e9, 0.8e9, 1.6e9])
    cn_cache_grid: List[int] = field(default_factory=lambda: [2, 4, 8, 16, 32])  # >= branch slots per GPU
    # E4: cache sizes
    cache_sizes: List[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6, 8, 10])


@dataclass
class DiffusionServingWorkload:
    kind: str = "diffusion_serving"
    # real mode
    scenario: ServingScenario = ServingScenario.controlnet
    unet: UNetShape = field(default_factory=_tiny_unet)
    cond_channels: List[int] = field(default_factory=lambda: [8, 16])  # cond side = 2x latent
    cond_size: int = 0  # control image side; 0 = latent x the ControlNet's factor (bad-input check)
    scheduler: str = "euler"
    num_steps: int = 30
    guidance_scale: float = 7.5
    text_len: int = 16
    num_controlnets: int = 1  # per request (controlnet scenario)
    num_controlnets_built: int = 3
    cn_scales: List[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    control_guidance_start: float = 0.0
    control_guidance_end: float = 1.0
    lora_ranks: List[int] = field(default_factory=lambda: [8, 64])  # a request's LoRAs
    k_grid: List[int] = field(default_factory=lambda: [0, 5, 10, 20])
    # quality scenario: Nirvana-K (K of 50 steps skipped) from a cached result of a request whose
    # prompt embeddings differ by this much noise ([R])
    nirvana_k_grid: List[int] = field(default_factory=lambda: [10, 20])
    nirvana_prompt_noise: float = 0.1
    # Emulated remote LoRA store: each file stands for lora_paper_bytes (SDXL LoRA) at this bandwidth.
    lora_paper_bytes: float = 0.3e9
    remote_bw_bytes_per_s: float = 0.4e9
    remote_latency_s: float = 0.02
    time_scale: float = 1.0
    requests: int = 3  # timed requests per variant (after one warm-up)
    repeats: int = 3  # lora_api: repetitions per operation
    torch_threads: int = 1
    trace: AddonTraceSpec = field(default_factory=AddonTraceSpec)
    sim: AddonSimSpec = field(default_factory=AddonSimSpec)
