"""Bad real-mode input fails at preflight with one line naming the field and the numbers."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from impl.common.api import ConfigError
from impl.common.varlen.lengths import LengthDist
from impl.common.workloads.varlen import VarlenWorkload
from impl.hotspa.real_config import HotSPaRealKnobs
from impl.hotspa.system import HotSPa

NO_FAULT = SimpleNamespace(kind="none")


def _system(**kw):
    cfg = HotSPa.Config(**{"grouping": "explicit", "boundaries": [2048, 1024, 0], "strategies": [[1, 2, 1], [2, 1, 1]],
                           **kw})
    return HotSPa(cfg, "hotspa")


def _wl(**kw):
    return VarlenWorkload(**{"num_gpus": 2, "gpus_per_node": 2, "context": 2048,
                             "lengths": LengthDist(median=250, sigma=1.0, min_len=16, max_len=2048), **kw})


def _check(system, wl) -> str:
    with pytest.raises(ConfigError) as e:
        system.check("real", wl, None, NO_FAULT)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_the_spec5_setup_passes_preflight():
    _system().check("real", _wl(), None, NO_FAULT)


def test_a_sequence_longer_than_every_strategy_capacity():
    msg = _check(_system(boundaries=[4096, 1024, 0]), _wl(context=4096))
    assert msg == ("workload.context: sequences of up to 4096 tokens exceed every strategy's capacity (largest: "
                   "2048 tokens, strategy (1,2,1) = system.real.tokens_per_tp 1024 x tp x pp)")


def test_a_strategy_whose_dp_tp_pp_is_not_the_gpu_count():
    msg = _check(_system(strategies=[[1, 2, 1], [2, 2, 1]]), _wl())
    assert msg == "system.strategies[1]: dp*tp*pp = 2*2*1 = 4 != workload.num_gpus 2"


def test_a_strategy_too_small_for_its_group_and_a_non_explicit_grouping():
    msg = _check(_system(real=HotSPaRealKnobs(tokens_per_tp=512)), _wl())
    assert msg.startswith("workload.context: sequences of up to 2048 tokens exceed every strategy's capacity")
    msg = _check(_system(boundaries=[2048, 1536, 0]), _wl())
    assert msg == ("system.strategies[1]: (2,1,1) holds 1024 tokens per micro-batch (system.real.tokens_per_tp 1024 "
                   "x tp 1 x pp 1) < its group's bound 1536")
    cfg = HotSPa.Config(grouping="c1")
    assert _check(HotSPa(cfg, "hotspa"), _wl()).startswith("system.grouping: real mode runs explicit boundaries")
