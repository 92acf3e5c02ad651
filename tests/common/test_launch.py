"""The one process launcher: rank results come back as plain data, failures as one line."""
from __future__ import annotations

import dataclasses

import pytest

from impl.common.runtime.launch import launch

pytestmark = pytest.mark.real


@dataclasses.dataclass
class NotPlain:
    x: int


def _plain(ctx):
    return {"rank": ctx.rank, "world": ctx.world_size}


def _not_plain(ctx):
    return NotPlain(ctx.rank)


def _fails_on_1(ctx):
    if ctx.rank == 1:
        raise ValueError("rank one is broken")
    return ctx.rank


def test_results_in_rank_order():
    assert launch(_plain, 2, label="t").results == [{"rank": 0, "world": 2}, {"rank": 1, "world": 2}]


def test_a_result_that_is_not_plain_data_is_one_line_naming_the_rank():
    with pytest.raises(RuntimeError) as e:
        launch(_not_plain, 2, label="t", timeout_s=60)
    msg = str(e.value)
    assert "not plain data" in msg and "rank" in msg and "\n" not in msg


def test_a_failing_rank_is_named():
    with pytest.raises(RuntimeError) as e:
        launch(_fails_on_1, 2, label="t", timeout_s=60)
    assert "rank 1" in str(e.value) and "rank one is broken" in str(e.value)
