"""The registered variants: each one's own numbers are the ones its record reports."""
from __future__ import annotations

import numpy as np
import pytest

from impl.swiftdiffusion.variants import VARIANTS
from tests.support.inprocess import run_job

# the E1 row latency each variant stands for (metric latency_<path>_<tag>_s), default nirvana_k = 10
OWN_E1_PATH = {"katz": "katz", "diffusers": "diffusers", "nirvana": "nirvana10", "nolora": "nolora",
               "distrifusion": "distrifusion"}


def test_every_variant_has_an_expected_e1_path():
    assert set(OWN_E1_PATH) == set(VARIANTS.names())


@pytest.mark.parametrize("name", VARIANTS.names())
def test_e1_latency_is_the_variants_own_row_latency(name, tmp_path):
    res = run_job(["mode=sim", "system=swiftdiffusion/swiftdiffusion", f"system.variant={name}",
                   "workload=diffusion_serving_h800", "hardware=h800", "workload.sim.scenario=e1"], tmp_path)
    tags = [k[len("latency_katz_"):-2] for k in res.metrics if k.startswith("latency_katz_")]
    assert tags
    own = [res.metrics[f"latency_{OWN_E1_PATH[name]}_{tag}_s"].value for tag in tags]
    assert res.metrics["latency_s"].value == float(np.mean(own))
