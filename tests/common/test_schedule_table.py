"""ScheduleTable: the columnar schedule form round-trips every generator's schedule exactly,
and malformed arrays fail with one line naming the field."""
import numpy as np
import pytest

from impl.adaptra.builder import adaptra_schedule
from impl.common.api import ConfigError
from impl.common.schedule.comm import compute_only, insert_comm
from impl.common.schedule.generators import generate
from impl.common.schedule.ir import parse_schedule
from impl.common.schedule.table import NO_PEER, OP_CODES, ScheduleTable


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "zb", "zb_uncapped"])
@pytest.mark.parametrize("S,N", [(1, 2), (3, 7), (6, 16)])
def test_round_trip_is_exact(name, S, N):
    sched = insert_comm(generate(name, S, N))
    table = ScheduleTable.from_schedule(sched)
    assert len(table) == sum(len(r) for r in sched.values())
    assert table.num_stages == S
    assert table.to_schedule() == sched
    assert ScheduleTable.from_schedule(compute_only(sched)).to_schedule() == compute_only(sched)
    s = S - 1
    assert [table.action(s, k) for k in range(table.row_length(s))] == sched[s]


def test_round_trip_adaptra_and_columns():
    sched, _ = adaptra_schedule([1.0] * 4, [1.0] * 4, [1.0] * 4, [0.0, 2.0, 0.0], 8)
    sched = insert_comm(sched)
    assert ScheduleTable.from_schedule(sched).to_schedule() == sched
    t = ScheduleTable.from_schedule(parse_schedule("0: F0 SF0>1 RB0<1 BW0\n1: RF0<0 F0 BW0 SB0>0"))
    assert [OP_CODES[c].value for c in t.op] == ["F", "SF", "RB", "BW", "RF", "F", "BW", "SB"]
    assert t.peer.tolist() == [NO_PEER, 1, 1, NO_PEER, 0, NO_PEER, NO_PEER, 0]
    assert t.offsets.tolist() == [0, 4, 8]
    with pytest.raises(ValueError):
        t.op[0] = 1  # read-only: a table handed to the simulator cannot change under it


def test_bad_tables_fail_with_one_line():
    z = np.zeros(2, np.int64)
    with pytest.raises(ConfigError, match="ScheduleTable.mb has 1 rows, offsets say 2"):
        ScheduleTable(np.array([0, 2]), np.zeros(2, np.int8), np.zeros(1, np.int64), z)
    with pytest.raises(ConfigError, match="ScheduleTable.op holds a code outside 0..7"):
        ScheduleTable(np.array([0, 2]), np.array([0, 9], np.int8), z, z)
    with pytest.raises(ConfigError, match="offsets must start at 0"):
        ScheduleTable(np.array([0, 3, 2]), np.zeros(2, np.int8), z, z)
    with pytest.raises(ConfigError, match="ScheduleTable.peer must be -1 for compute ops"):
        ScheduleTable(np.array([0, 2]), np.array([0, 4], np.int8), z, np.array([1, 1]))  # F with a peer
    with pytest.raises(ConfigError, match="ScheduleTable.peer must be -1 for compute ops"):
        ScheduleTable(np.array([0, 2]), np.array([0, 4], np.int8), z, np.array([NO_PEER, NO_PEER]))  # SF without
    with pytest.raises(ConfigError, match="expected 0..1"):
        ScheduleTable.from_schedule({0: [], 2: []})


def test_the_callers_arrays_stay_writable():
    op = np.array([0, 3], np.int8)
    t = ScheduleTable(np.array([0, 2]), op, np.zeros(2, np.int64), np.full(2, NO_PEER))
    op[0] = 3  # the table holds read-only views; the caller's own array is not frozen
    assert not t.op.flags.writeable
