import pytest

from impl.common.api import ConfigError
from impl.swiftdiffusion.system import SwiftDiffusionSystem

from .conftest import tiny_workload


def _sys(**kw):
    return SwiftDiffusionSystem(SwiftDiffusionSystem.Config(**kw), "swiftdiffusion")


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"system.k \(patch step bound K\) must be >= 0, got -2"):
        _sys(k=-2)
    with pytest.raises(ConfigError, match="system.aggregation: unknown value 'avg'"):
        _sys(aggregation="avg")


def test_preflight_checks_workload():
    s = _sys()
    wl = tiny_workload(k_grid=[0, 2, 5])
    s.check("real", wl, None, None)
    wl.cond_size = 40
    with pytest.raises(ConfigError, match=r"workload.cond_size: .* side 40, the ControlNet needs 32"):
        s.check("real", wl, None, None)
    wl = tiny_workload(k_grid=[0, -1])
    with pytest.raises(ConfigError, match=r"system.k \(patch step bound K\) must be >= 0, got -1"):
        s.check("real", wl, None, None)
    wl = tiny_workload(k_grid=[6])
    with pytest.raises(ConfigError, match="must be < workload.num_steps = 6"):
        s.check("real", wl, None, None)
