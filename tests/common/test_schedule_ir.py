"""Schedule IR: text form round-trips, and malformed text fails with a message that says why."""
from __future__ import annotations

import pytest

from impl.common.schedule.comm import insert_comm
from impl.common.schedule.generators import generate
from impl.common.schedule.grid import format_grid
from impl.common.schedule.ir import Action, Op, format_schedule, parse_schedule


@pytest.mark.parametrize("text", ["F0", "B3", "W12", "BW7", "SF3>2", "RF3<2", "SB4>0", "RB4<1"])
def test_action_round_trip(text):
    a = Action.parse(text)
    assert str(a) == text
    assert Action.parse(str(a)) == a


def test_action_fields():
    a = Action.parse("SF3>2")
    assert (a.op, a.mb, a.peer) == (Op.SEND_F, 3, 2)
    assert a.op.is_send and not a.op.is_recv and not a.op.is_compute
    assert Action.parse("BW5") == Action(Op.BW, 5)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb"])
@pytest.mark.parametrize("with_comm", [False, True])
def test_schedule_round_trip(name, with_comm):
    sched = generate(name, 3, 5)
    if with_comm:
        sched = insert_comm(sched)
    assert parse_schedule(format_schedule(sched)) == sched


def test_parse_ignores_comments_and_blank_lines():
    text = "# header\n\n0: F0 SF0>1  # trailing\n1: RF0<0 F0\n"
    assert parse_schedule(text) == {0: [Action(Op.F, 0), Action(Op.SEND_F, 0, 1)],
                                    1: [Action(Op.RECV_F, 0, 0), Action(Op.F, 0)]}


@pytest.mark.parametrize("text, fragment", [
    ("0: X3", "cannot parse schedule action 'X3'"),
    ("0: SF3<2", "wrong direction marker"),
    ("0: RB3>2", "wrong direction marker"),
    ("0: F-1", "cannot parse"),
    ("0: SF3", "needs a peer"),
    ("0: F3>1", "wrong direction marker"),
    ("zero: F0", "expected '<stage>: <actions>'"),
    ("0 F0", "expected '<stage>: <actions>'"),
    ("0: F0\n0: F1", "stage 0 listed twice"),
])
def test_parse_errors_say_why(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_schedule(text)


def test_grid_rows_are_positions_and_aligned_shows_bubbles():
    sched = generate("1f1b", 2, 2)
    grid = format_grid(sched).splitlines()
    assert grid[0].split() == ["step", "stage", "0", "stage", "1"]
    assert grid[1].split() == ["0", "F0", "F0"]  # position 0 of each stage
    aligned = format_grid(sched, aligned=True).splitlines()
    # stage 1 cannot start F0 before stage 0 finished it: row 0 has only stage 0
    assert aligned[1].split() == ["0", "F0"]
    assert aligned[2].split() == ["1", "F1", "F0"]
    assert len(aligned) - 1 == 2 * 2 + 2 * (2 - 1)  # 2N ops per stage + 1F1B's 2(S-1) bubble
