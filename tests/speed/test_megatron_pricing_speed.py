"""Pricing every launch of the H100 runs file (1,208 launches: parse, documents, features and one
prediction each) with the calibrated profile: the issue's budget is < 10 s on a 2-core host."""
from __future__ import annotations

import pathlib

from impl.common.hardware import load_hardware
from impl.common.megatron import fit as megafit
from impl.common.megatron.runs import load_runs

RUNS = pathlib.Path(__file__).resolve().parents[2] / "impl/common/megatron/data/megatron_h100_feb2024.jsonl.gz"


def _price_all() -> int:
    hw = load_hardware("h100-megatron")
    launches = load_runs(RUNS)
    preds = [megafit.predict(p, hw) for p in megafit.featurize(launches, hw)]
    return len(preds)


def test_price_every_launch(benchmark):
    n = benchmark.pedantic(_price_all, rounds=1, iterations=1)
    assert n >= 1200
