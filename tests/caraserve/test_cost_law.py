"""The cost-law job (system=caraserve/caraserve_cost_law; impl/caraserve/README.md): the fit picks the law that generated the
data; a tiny real run through the harness records finite fits; sim mode is refused."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from impl.caraserve.cost_law_bench import LAWS, CostLaw, fit_law, rank_mixes
from impl.common.api import ConfigError
from impl.common.workloads.serving import ServingWorkload
from tests.support.inprocess import run_job

TINY = ["system=caraserve/caraserve_cost_law", "workload=serving_tiny", "mode=real", "system.batch_sizes=[1,2,4]",
        "system.repeats=1", "system.warmup=0", "system.random_mixes=0"]


def _synthetic(law: str, seed: int = 1):
    mixes = rank_mixes([1, 2, 4, 8, 16, 32], [8, 16, 32, 64], 2, np.random.default_rng(0))
    rng = np.random.default_rng(seed)
    rank_term = {"max_r": lambda m: len(m) * max(m), "sum_r": sum}[law]
    times = [(2e-3 + 3e-4 * len(m) + 5e-6 * rank_term(m)) * (1 + 0.02 * rng.standard_normal()) for m in mixes]
    return mixes, times


def test_pad_law_data_is_fitted_better_by_the_pad_feature():
    mixes, times = _synthetic("max_r")
    (a0, a1, a2), r2_pad = fit_law(mixes, times, "max_r")
    _, r2_seg = fit_law(mixes, times, "sum_r")
    assert r2_pad > 0.99 and r2_seg < r2_pad - 0.02
    assert a2 == pytest.approx(5e-6, rel=0.1) and a1 == pytest.approx(3e-4, rel=0.3)
    # ...and the other way round, so a swapped feature cannot pass both
    mixes, times = _synthetic("sum_r")
    assert fit_law(mixes, times, "sum_r")[1] > fit_law(mixes, times, "max_r")[1] + 0.02


def test_mixes_separate_the_laws():
    mixes = rank_mixes([1, 4], [8, 64], 0, np.random.default_rng(0))
    assert (8, 8, 8, 64) in mixes and (8, 64, 64, 64) in mixes and len(mixes) == len(set(mixes)) == 6


def test_tiny_real_run_records_r2_and_finite_fits(tmp_path):
    res = run_job(TINY, tmp_path)
    for k in ("bgmv", "sgmv"):
        for law in LAWS:
            for sfx in ("", "_chunked"):
                m = res.metrics[f"{k}_r2_{law}{sfx}"]
                assert -math.inf <= m.value <= 1.0 and m.better == "higher"
                fit = res.info["kernels"][k]["fits"][law + sfx]
                assert len(fit["coef_s"]) == 3 and all(math.isfinite(c) and c >= 0 for c in fit["coef_s"])
        assert res.metrics[f"{k}_follows_{'max_r' if k == 'bgmv' else 'sum_r'}"].value in (0.0, 1.0)
    assert len(res.info["samples"]) == 4 + 5 + 6  # uniform mixes, + 1 skewed at B=2 ((8, 64) once), + 2 at B=4
    json.dumps(res.info, allow_nan=False)
    assert res.artifacts == ["cost_law.png"] and (tmp_path / "cost_law.png").stat().st_size > 0


@pytest.mark.parametrize("overrides, field", [(["mode=sim"], "mode"), (["workload=pipeline_s4"], "workload.kind")])
def test_refused_with_one_line(tmp_path, overrides, field):
    with pytest.raises(ConfigError) as exc:
        run_job(TINY + overrides, tmp_path)
    msg = str(exc.value)
    assert msg.startswith(f"{field}:") and "\n" not in msg


def test_check_refuses_sim_mode():
    sys_ = CostLaw(CostLaw.Config(), "caraserve_cost_law")
    with pytest.raises(ConfigError, match=r"^mode: caraserve_cost_law times real decode steps; it has no 'sim' mode"):
        sys_.check("sim", ServingWorkload(), None, None)
    sys_.check("real", ServingWorkload(), None, None)
