"""The default run's closing text: one section per step, the calibration job without any ratio
against the plan's baseline, then the ADAPTRA/ZB/1F1B tables with a one-line verdict each."""
from __future__ import annotations

import re

from bench.default_plan import closing_story, load_plan
from tests.bench.test_compare import metric, record


def test_closing_story_reads_calibration_then_sim_then_real():
    plan = load_plan()
    calib = [record("c", "calibrate", {"matmul_fp32_flops": metric(3e10, "flop/s", "higher")}, mode="real",
                    experiment="adhoc")]
    sim = [record(f"s{s}", s, {"iteration_time_s": metric(t)}, experiment="demo/sim")
           for s, t in (("zb", 1.12), ("1f1b", 1.2), ("adaptra", 0.48))]
    real = [record(f"r{s}", s, {"iteration_time_s": metric(t, n=3, p10=t, p90=t * 1.1)}, mode="real",
                   experiment="demo/real") for s, t in (("zb", 2.5), ("adaptra", 1.0))]
    text = closing_story(plan, [calib, sim, real])
    first, second, third = re.split(r"^#\d ", text, flags=re.M)[1:]
    assert first.startswith("calibrate") and "matmul_fp32_flops" in first
    assert "zb" not in first and "times better" not in first and " x" not in first
    assert second.startswith("ADAPTRA vs ZB vs 1F1B")
    assert "=> adaptra 2.33x, 1f1b 0.93x better than zb on iteration_time_s (simulated)" in second
    assert "=> adaptra 2.50x better than zb on iteration_time_s (measured)" in third
