"""Rank-aware cost model: fit quality gate, monotonicity, deterministic routing per seed."""
from __future__ import annotations

import numpy as np
import pytest

from impl.caraserve.cost import PoorFitError, fit, profile_grid
from impl.caraserve.router import make_router
from impl.common.servesim import ServingCost
from impl.common.workloads.serving import PaperModel

COST = ServingCost(model=PaperModel(name="llama2-7b", num_layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008,
                                     vocab=32000))


@pytest.mark.parametrize("kernel", ["bgmv", "mbgmv"])
def test_fit_is_good_and_monotone(kernel):
    dec, pre = profile_grid(0)
    m = fit(dec, pre, lambda c, r: COST.decode_s(c, r, kernel), lambda l, r: COST.prefill_s(l, r), kernel=kernel)
    assert m.dec_r2 >= 0.9 and m.pre_r2 >= 0.9
    m.check()
    rng = np.random.default_rng(1)
    for _ in range(200):  # adding a request never lowers a prediction
        n = int(rng.integers(0, 40))
        ctx = [int(x) for x in rng.integers(4, 900, n)]
        rk = [int(x) for x in rng.choice([8, 16, 32, 64], n)]
        c, r = int(rng.integers(4, 900)), int(rng.choice([8, 16, 32, 64]))
        assert m.decode_s(ctx + [c], rk + [r]) >= m.decode_s(ctx, rk)
        assert m.prefill_s(ctx + [c], rk + [r]) >= m.prefill_s(ctx, rk)
    if kernel == "bgmv":  # BGMV follows max r: one rank-64 row costs the whole batch
        assert m.decode_s([100] * 8, [8] * 7 + [64]) > m.decode_s([100] * 8, [8] * 8)
    for c_, r_ in dec[:20]:  # the simulator's own cost is monotone too
        assert COST.decode_s(c_ + [50], r_ + [8], kernel) >= COST.decode_s(c_, r_, kernel)


def test_poor_fit_refuses_to_schedule():
    dec, pre = profile_grid(0)
    rng = np.random.default_rng(0)
    noisy = fit(dec, pre, lambda c, r: float(rng.random()), lambda l, r: float(rng.random()))
    with pytest.raises(PoorFitError, match=r"system.min_r2: cost-model fit too poor to schedule on \(decode R\^2"):
        make_router("rank_aware", model=noisy, slo_of=lambda r: 1.0)
