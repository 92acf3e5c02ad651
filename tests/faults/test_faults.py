"""Fault specs: which delay each link carries when, and one-line errors for impossible specs."""
from __future__ import annotations

import pytest

from impl.common.fault_model.link_delay import link_delays_at, validate_link_delay
from impl.common.fault_model.spec import DelayEvent, LinkDelay, NoFault
from impl.common.api import ConfigError


def test_link_delays_follow_start_stop_and_trace():
    f = LinkDelay(links=[[2, 3]], delay_s=0.03, start_iter=2, stop_iter=5)
    assert [link_delays_at(f, i, 4) for i in (1, 2, 4, 5)] == [{}, {(2, 3): 0.03}, {(2, 3): 0.03}, {}]
    trace = LinkDelay(trace=[DelayEvent(0, [[0, 1]], 0.02), DelayEvent(3, [[1, 2], [2, 3]], 0.05),
                             DelayEvent(6, [], 0.0)])
    assert link_delays_at(trace, 2, 4) == {(0, 1): 0.02}
    assert link_delays_at(trace, 4, 4) == {(1, 2): 0.05, (2, 3): 0.05}
    assert link_delays_at(trace, 7, 4) == {}
    assert link_delays_at(LinkDelay(links=[[7, 6]], delay_s=0.06), 0, 8) == {(6, 7): 0.06}


def test_negative_indices_name_the_last_link():
    f = LinkDelay(links=[[-2, -1]], delay_s=0.03)
    assert link_delays_at(f, 0, 4) == {(2, 3): 0.03}
    assert link_delays_at(f, 0, 8) == {(6, 7): 0.03}


def test_no_fault_has_no_delay():
    assert link_delays_at(NoFault(), 0, 4) == {}


@pytest.mark.parametrize("fault, message", [
    (LinkDelay(links=[[3, 4]], delay_s=0.01), "fault.links: link (3, 4) does not exist in a 4-stage pipeline"),
    (LinkDelay(links=[[0, 2]], delay_s=0.01), "link (0, 2) does not exist"),
    (LinkDelay(links=[[0, 1, 2]], delay_s=0.01), "must be a pair"),
    (LinkDelay(delay_s=-0.01), "fault.delay_s must be >= 0"),
    (LinkDelay(start_iter=5, stop_iter=5), "fault.stop_iter (5) must be > fault.start_iter (5)"),
    (LinkDelay(detection="psychic"), "fault.detection: unknown value 'psychic'"),
    (LinkDelay(trace=[DelayEvent(0, [[5, 6]], 0.01)]), "fault.trace[0].links"),
    (LinkDelay(trace=[DelayEvent(3, [[0, 1]], 0.01), DelayEvent(2, [[0, 1]], 0.01)]), "fault.trace[1].start_iter"),
])
def test_impossible_specs_fail_in_one_line(fault, message):
    with pytest.raises(ConfigError) as err:
        validate_link_delay(fault, 4)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_slowdown_severity_scales_each_factors_excess():
    from impl.common.fault_model.compute_slowdown import slowdown_at, validate_compute_slowdown
    from impl.common.fault_model.spec import ComputeSlowdown

    f = ComputeSlowdown(gpus=[0, 2, 3], factors=[12.53, 2.57, 0.8])
    assert slowdown_at(f, 0, 4) == [12.53, 1.0, 2.57, 0.8]
    f.severity = 0.5
    assert slowdown_at(f, 0, 4) == pytest.approx([6.765, 1.0, 1.785, 0.9])
    f.severity = 0.0
    assert slowdown_at(f, 0, 4) == [1.0] * 4
    f.severity = -1.0
    with pytest.raises(ConfigError, match="fault.severity must be >= 0"):
        validate_compute_slowdown(f, 4)
