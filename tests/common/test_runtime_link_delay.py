"""Runtime link-delay table (TCPStore exchange) and the measured-mode change detector."""
from __future__ import annotations


import pytest
import torch.distributed as dist

from impl.common.fault_model.spec import DelayEvent, LinkDelay
from impl.common.api import ConfigError
from impl.common.runtime.link_delay import DelayEstimator, LinkDelayController


def test_table_per_iteration_covers_every_link():
    fault = LinkDelay(links=[[0, 1]], delay_s=0.02, start_iter=1, stop_iter=3)
    ctl = LinkDelayController(fault, 4)
    assert ctl.delays_at(0) == {(0, 1): 0.0, (1, 2): 0.0, (2, 3): 0.0}
    assert ctl.delays_at(1)[(0, 1)] == 0.02 and ctl.delays_at(3)[(0, 1)] == 0.0
    assert ctl.detection == "oracle"


def test_trace_and_fixed_tables():
    fault = LinkDelay(trace=[DelayEvent(0, [[1, 2]], 0.01), DelayEvent(2, [[0, 1], [2, 3]], 0.03)])
    ctl = LinkDelayController(fault, 4)
    assert ctl.delays_at(1) == {(0, 1): 0.0, (1, 2): 0.01, (2, 3): 0.0}
    assert ctl.delays_at(2) == {(0, 1): 0.03, (1, 2): 0.0, (2, 3): 0.03}
    assert LinkDelayController({(1, 2): 0.005}, 3).delays_at(7) == {(0, 1): 0.0, (1, 2): 0.005}


@pytest.mark.parametrize("fault", [LinkDelay(links=[[3, 4]], delay_s=0.01), {(3, 4): 0.01}])
def test_missing_link_is_a_config_error(fault):
    with pytest.raises(ConfigError, match=r"fault.links: link \(3, 4\) does not exist in a 4-stage pipeline"):
        LinkDelayController(fault, 4)


def test_bad_detection_mode():
    with pytest.raises(ConfigError, match="fault.detection"):
        LinkDelayController(None, 2, detection="psychic")


def test_store_round_trip():
    store = dist.HashStore()
    ctl = LinkDelayController(LinkDelay(links=[[0, 1]], delay_s=0.125), 3)
    ctl.publish(store, 5)
    assert ctl.read(store, 5) == {(0, 1): 0.125, (1, 2): 0.0}


def test_estimator_needs_patience_and_ignores_jitter():
    est = DelayEstimator(3, patience=2)
    assert est.update({(0, 1): 0.0012, (1, 2): 0.0008}) == {(0, 1): 0.0, (1, 2): 0.0}  # noise
    assert est.update({(0, 1): 0.0615, (1, 2): 0.0009})[(0, 1)] == 0.0  # one sample: not yet
    assert est.update({(0, 1): 0.0605, (1, 2): 0.0007})[(0, 1)] == pytest.approx(0.060)
    assert est.update({(0, 1): 0.0630})[(0, 1)] == pytest.approx(0.060)  # within 10%: keep
    est.update({(0, 1): 0.0009})
    assert est.update({(0, 1): 0.0011})[(0, 1)] == 0.0  # delay gone, after two iterations
