"""SwiftDiffusion (Katz) and its baselines as registered variants (what each ``system.variant``
name stands for in the sims and in real mode).

| variant      | E1 latency of a row   | E2 serving                           | E3 | real scenarios          |
|--------------|-----------------------|--------------------------------------|----|-------------------------|
| katz         | Katz                  | Katz at its best base:pool split     | x  | all (controls inside)   |
| diffusers    | Diffusers             | Diffusers replicas                   |    | -                       |
| nirvana      | Diffusers skipping K  | Diffusers replicas skipping K steps  |    | quality                 |
| nolora       | Katz without LoRAs    | Katz split search, LoRAs dropped     |    | quality                 |
| distrifusion | patch-parallel steps  | (E1 only)                            |    | -                       |
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from impl.common.registry import Registry

# real scenarios a baseline variant runs itself (the others run their controls inside the katz job)
BASELINE_SCENARIOS = ("quality",)


@dataclass(frozen=True)
class Variant:
    # which latency of an E1 row is this system's own (run.e1's rows:
    # tag, diffusers, katz, artifact ref, calibration row, nirvana, nolora, distrifusion)
    e1_column: int
    # E2 runs Diffusers replicas (no base:pool split search)
    e2_replicas: bool = False
    # Nirvana-like approximate caching: replicas skip system.nirvana_k steps on a cache hit
    skips_steps: bool = False
    # the Katz sim drops the requests' LoRAs
    drops_loras: bool = False
    # E3 sweeps it (its knobs are Katz's)
    sweeps: bool = False
    # modelled for E1 only (its GPU count is not in the sources)
    e1_only: bool = False
    # real mode runs it in every scenario (the baselines' controls inside), else in BASELINE_SCENARIOS
    runs_all_real: bool = False
    # real ``quality``: the path of run_quality whose times are this system's own; None = no real mode
    quality_path: Optional[Callable] = None


VARIANTS: Registry[Variant] = Registry("value", "system.variant")
VARIANTS.add("katz", Variant(2, sweeps=True, runs_all_real=True,
                             quality_path=lambda cfg, wl: f"k{max(wl.k_grid)}"))
VARIANTS.add("diffusers", Variant(1, e2_replicas=True))
VARIANTS.add("nirvana", Variant(5, e2_replicas=True, skips_steps=True,
                                quality_path=lambda cfg, wl: f"nirvana{cfg.nirvana_k}"))
VARIANTS.add("nolora", Variant(6, drops_loras=True, quality_path=lambda cfg, wl: "nolora"))
VARIANTS.add("distrifusion", Variant(7, e1_only=True))
