import numpy as np
import pytest

from impl.common.api import ConfigError
from impl.common.cost.seqlen import SeqCost, fit_seq_cost


def test_fit_recovers_quadratic_with_noise():
    rng = np.random.default_rng(0)
    s = np.repeat([64, 128, 256, 512, 1024, 2048], 5).astype(float)
    true = SeqCost(a=2e-9, b=3e-6, c=4e-4)
    t = np.array([true.time_s(x) for x in s]) * (1 + 0.01 * rng.standard_normal(len(s)))
    fit = fit_seq_cost(s, t)
    assert fit.source == "fit" and fit.r2 > 0.99
    assert fit.a == pytest.approx(true.a, rel=0.05)
    assert fit.b == pytest.approx(true.b, rel=0.1)


def test_packed_rows_use_sum_of_squares():
    c = SeqCost(a=1.0, b=10.0, c=100.0)
    assert c.packed_time_s([3, 4]) == 1.0 * (9 + 16) + 10.0 * 7 + 100.0
    assert c.packed_time_s([7]) == c.time_s(7)


def test_poor_fit_and_too_few_lengths_refused():
    with pytest.raises(ConfigError, match=r"R² .* below 0.9"):
        fit_seq_cost([1, 2, 3, 4, 5, 6], [1, 0, 1, 0, 1, 0])
    with pytest.raises(ConfigError, match=">= 3 distinct lengths"):
        fit_seq_cost([8, 8, 16, 16], [1, 1, 2, 2])
