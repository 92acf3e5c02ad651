"""Even-slack warm-up quotas: ADAPTRA's Alg. 1, the initial (delay-blind) warm-up plan.

Shared: ADAPTRA's schedule starts from it and the ZB baseline (:func:`impl.common.schedule.
generators.zb_warmup`) is exactly it at ``x_max = min(N, 2S−1)``.

With no delay information the best a schedule can do is spread the activation budget evenly
over the links, because the slack ``Δ_i = x_i − x_{i+1}`` of a link is what absorbs a later
delay on it (the paper's analytical model). Alg. 1 therefore starts stage 0 at the memory cap and hands out
``x_max − 1`` slack as evenly as possible, the first ``r`` links getting one extra.
"""
from __future__ import annotations

from impl.common.api import ConfigError


def initial_warmup(num_stages: int, x_max: int) -> list[int]:
    """Warm-up forward counts ``x_0..x_{S-1}`` maximising the smallest slack (Alg. 1).

    ``x_0 = x_max``; ``Δavg = ⌊(x_max−1)/(S−1)⌋``, ``r = (x_max−1) mod (S−1)``; link ``i−1``
    gets ``Δavg+1`` for ``i ≤ r`` else ``Δavg``. The last stage always ends at 1. When
    ``x_max < S`` some slacks are 0 (the plan is then memory-bound, not a bug). Callers clip
    ``x_max`` to the micro-batch count: a quota above N makes a stage wait forever.
    """
    if num_stages < 1:
        raise ConfigError(f"num_stages must be >= 1, got {num_stages}")
    if x_max < 1:
        raise ConfigError(f"x_max (activations that fit) must be >= 1, got {x_max}")
    if num_stages == 1:
        return [x_max]
    delta_avg, r = divmod(x_max - 1, num_stages - 1)
    x = [x_max]
    for i in range(1, num_stages):
        x.append(x[-1] - (delta_avg + 1 if i <= r else delta_avg))
    return x
