"""The multi-LoRA kernel-latency law of Toppings (CaraServe's ATC'25 version), fitted on our kernels.

Toppings fits the decode LoRA kernel's latency alone (not the whole step) with two parameters,
R^2 0.96, on batch 4 / 8 / 16 / 32 x rank 8 / 16 / 32 / 64:

- BGMV (Punica, rows padded to the batch's max rank): T = alpha x batch x max rank + beta
- MBGMV (S-LoRA, no padding):                           T = alpha x sum of ranks + beta

alpha and beta are not published; :func:`fit_kernel_law` fits them by non-negative least
squares on timings of *our* kernels: in the simulator, the LoRA term of the sim's decode cost
(``ServingCost.decode_s`` with LoRA minus without, :func:`sim_kernel_times`); in real mode, the
reference kernels of :mod:`impl.common.llm.kernels` timed on the CPU
(``experiment=caraserve/cost_law``). The rank-aware router's decode model is the base step (fitted
on the base model's decode cost) plus this law (:func:`impl.caraserve.cost.fit_with_law`).

The grid: per (batch, max rank) one uniform batch (there B x max r = sum r, the laws agree) and
one mixed batch (one request at the max rank, the rest drawn from the ranks up to it, seeded),
where the two laws disagree; so the fit can tell which law a kernel follows.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np

from impl.common.api import ConfigError

LAW_BATCHES = (4, 8, 16, 32)
LAW_RANKS = (8, 16, 32, 64)
LAW_FORMS = {"bgmv": "alpha x batch x max rank + beta", "mbgmv": "alpha x sum of ranks + beta"}


def law_feature(ranks: Sequence[int], kernel: str) -> float:
    """batch x max rank (BGMV) or sum of ranks (MBGMV); 0 for an empty batch."""
    if not ranks:
        return 0.0
    if kernel not in LAW_FORMS:
        raise ConfigError(f"kernel law: unknown kernel {kernel!r} (one of: {', '.join(LAW_FORMS)})")
    return float(len(ranks) * max(ranks)) if kernel == "bgmv" else float(sum(ranks))


def law_grid(seed: int = 0, batches: Sequence[int] = LAW_BATCHES, ranks: Sequence[int] = LAW_RANKS) -> list[tuple]:
    """Rank mixes of the Toppings grid: per batch and max rank, the uniform batch and one mixed."""
    rng = np.random.default_rng(seed)
    out = []
    for B in batches:
        for r in ranks:
            out.append(tuple([int(r)] * B))
            lower = [x for x in ranks if x <= r]
            out.append(tuple(sorted([int(r)] + [int(x) for x in rng.choice(lower, size=B - 1)])))
    return out


@dataclass(frozen=True)
class KernelLaw:
    kernel: str  # bgmv | mbgmv
    alpha_s: float  # seconds per unit of the feature (per row-rank for BGMV, per rank for MBGMV)
    beta_s: float  # seconds, the launch / fixed part
    r2: float
    samples: int
    fitted_to: str

    def to_dict(self) -> dict:
        return {**asdict(self), "form": LAW_FORMS[self.kernel]}


def fit_kernel_law(mixes: Sequence[Sequence[int]], times_s: Sequence[float], kernel: str,
                   fitted_to: str) -> KernelLaw:
    """alpha, beta >= 0 by least squares on measured kernel times; R^2 as Toppings reports it."""
    from impl.caraserve.cost import nnls_fit

    if len(mixes) != len(times_s) or len(mixes) < 3:
        raise ConfigError(f"kernel law: need >= 3 timed rank mixes with one time each, got {len(mixes)} / {len(times_s)}")
    X = np.array([[law_feature(m, kernel), 1.0] for m in mixes])
    coef, r2 = nnls_fit(X, np.asarray(times_s, dtype=float))
    return KernelLaw(kernel=kernel, alpha_s=float(coef[0]), beta_s=float(coef[1]), r2=float(r2), samples=len(mixes),
                     fitted_to=fitted_to)


def sim_kernel_times(cost, mixes: Sequence[Sequence[int]], kernel: str, context: int = 256) -> list[float]:
    """The simulator's LoRA kernel time of each mix: its decode step with LoRA minus without (the
    base step), ``context`` tokens of KV cache per request."""
    out = []
    for m in mixes:
        ctx = [context] * len(m)
        out.append(cost.decode_s(ctx, list(m), kernel) - cost.decode_s(ctx, list(m), kernel, lora=False))
    return out


def fit_sim_law(cost, kernel: str, seed: int = 0) -> KernelLaw:
    mixes = law_grid(seed)
    return fit_kernel_law(mixes, sim_kernel_times(cost, mixes, kernel), kernel,
                          fitted_to=f"simulator LoRA kernel cost (ServingCost.decode_s with minus without LoRA), "
                                    f"{cost.hardware_name or 'profile'}, batch {'/'.join(map(str, LAW_BATCHES))} x "
                                    f"rank {'/'.join(map(str, LAW_RANKS))}, uniform and mixed")


def time_kernel(kernel: str, mix: Sequence[int], adapters: dict, x, fn: Callable | None = None) -> float:
    """Wall time of one call of our reference kernel over a decode batch, each row on its own
    adapter (as in serving, one distinct adapter per request) of rank ``mix[i]``: ``adapters`` maps
    rank -> (A [r, d], B [d, r]) and row i uses a view of that rank's; ``x`` [B, d]."""
    import time

    import torch

    from impl.common.llm import kernels as K

    idx = torch.arange(len(mix), dtype=torch.long)
    y = torch.zeros_like(x)
    As, Bs = [adapters[r][0] for r in mix], [adapters[r][1] for r in mix]
    if kernel == "bgmv":
        A, B = K.stack_padded(As, Bs)
        scales = torch.ones(len(mix))
        t0 = time.perf_counter()
        K.bgmv(y, x, A, B, idx, scales)
    elif kernel == "mbgmv":
        t0 = time.perf_counter()
        K.mbgmv(y, x, As, Bs, [1.0] * len(mix), idx)
    else:
        raise ConfigError(f"kernel law: unknown kernel {kernel!r} (one of: {', '.join(LAW_FORMS)})")
    return time.perf_counter() - t0
