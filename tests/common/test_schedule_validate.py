"""Generators, insert_comm and validate_schedule: every generated schedule is valid, and each
kind of broken schedule is rejected with a message naming the problem."""
from __future__ import annotations

import pathlib

import pytest

from impl.common.api import ConfigError
from impl.common.schedule.comm import compute_only, insert_comm
from impl.common.schedule.generators import GENERATORS, generate, one_f_one_b, zb_warmup
from impl.common.schedule.ir import Action, Op, parse_schedule
from impl.common.schedule.validate import ScheduleError, peak_inflight, validate_schedule

GOLDEN = pathlib.Path(__file__).resolve().parent.parent / "golden"
SPLIT = ("zb", "zb_uncapped")  # generators that emit B and W split
GRID = [(S, N) for S in range(1, 7) for N in range(S, 3 * S + 1)] + [(4, 1), (4, 2), (6, 3)]


def A(text: str) -> Action:
    return Action.parse(text)


def sched(text: str):
    return parse_schedule(text)


@pytest.mark.parametrize("S,N", GRID)
@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generated_schedules_are_valid(name, S, N):
    compute = generate(name, S, N)
    split = name in SPLIT
    validate_schedule(compute, S, N, split_backward=split)
    full = insert_comm(compute)
    validate_schedule(full, S, N, split_backward=split)
    assert compute_only(full) == compute
    # exactly N messages per direction per link
    for s in range(S - 1):
        assert sum(a.op is Op.SEND_F for a in full[s]) == N
        assert sum(a.op is Op.SEND_B for a in full[s + 1]) == N


@pytest.mark.parametrize("S,N", GRID)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_survive_blocking_sends(name, S, N):
    assert validate_schedule(insert_comm(generate(name, S, N)), S, N, blocking_sends=True) is None


def test_plain_zb_placement_can_deadlock_blocking_sends():
    # why the blocking_sends option exists: stage 2 sends F2 before taking B0, stage 3 sends
    # B0 before taking F2 (compute separates the two, so parity cannot line them up)
    with pytest.raises(ScheduleError, match=r"deadlock \(blocking sends\)"):
        validate_schedule(insert_comm(generate("zb", 4, 9)), 4, 9, blocking_sends=True)


@pytest.mark.parametrize("S,N", GRID)
@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_insert_comm_for_blocking_sends(name, S, N):
    compute = generate(name, S, N)
    full = insert_comm(compute, blocking_sends=True)
    validate_schedule(full, S, N, blocking_sends=True)  # also re-checks placement and link order
    assert compute_only(full) == compute
    if name not in SPLIT:  # already rendezvous-safe: the repair changes nothing
        assert full == insert_comm(compute)


def test_blocking_repair_moves_sends_only_past_a_receive_in_zb():
    plain, safe = insert_comm(generate("zb", 4, 9)), insert_comm(generate("zb", 4, 9), blocking_sends=True)
    assert plain[0][:13] == safe[0][:13]  # identical up to F6
    # plain: ... F6 SF6>1 RB0<1 B0 ...; repaired: ... F6 RB0<1 SF6>1 B0 ...
    k = plain[0].index(A("SF6>1"))
    assert [str(a) for a in plain[0][k - 1:k + 3]] == ["F6", "SF6>1", "RB0<1", "B0"]
    assert [str(a) for a in safe[0][k - 1:k + 3]] == ["F6", "RB0<1", "SF6>1", "B0"]


@pytest.mark.parametrize("S,N", GRID)
def test_memory_footprints(S, N):
    assert peak_inflight(generate("gpipe", S, N)) == {s: N for s in range(S)}
    assert peak_inflight(generate("1f1b", S, N)) == {s: min(S - s, N) for s in range(S)}
    zb = generate("zb", S, N)
    validate_schedule(zb, S, N, warmup_quota=zb_warmup(S, N), memory_limit=[2 * S] * S)


def test_1f1b_golden():
    golden = parse_schedule((GOLDEN / "1f1b_S4_N8.txt").read_text())
    assert insert_comm(one_f_one_b(4, 8)) == golden
    assert compute_only(golden) == one_f_one_b(4, 8)


def test_rank_parity_order_in_1f1b():
    full = insert_comm(one_f_one_b(4, 8))
    for s, row in full.items():
        for a, b in zip(row, row[1:]):
            if a.op.is_compute or b.op.is_compute or a.peer != b.peer:
                continue
            first, second = (a, b)
            if s % 2 == 0:
                assert first.op.is_send and second.op.is_recv, f"stage {s}: {first} {second}"
            else:
                assert first.op.is_recv and second.op.is_send, f"stage {s}: {first} {second}"


@pytest.mark.parametrize("name,S,N", [("zb", 4, 12), ("zb", 6, 18), ("1f1b", 5, 10)])
def test_insert_comm_places_recv_before_consumer_and_send_after_producer(name, S, N):
    full = insert_comm(generate(name, S, N))
    for s, row in full.items():
        for k, a in enumerate(row):
            if a.op.is_recv:  # only other comm may sit between a RECV and its consumer
                nxt = next(b for b in row[k + 1:] if b.op.is_compute)
                assert nxt.mb == a.mb and (nxt.op is Op.F) == (a.op is Op.RECV_F)
            if a.op.is_send:
                prev = next(b for b in reversed(row[:k]) if b.op.is_compute)
                assert prev.mb == a.mb and (prev.op is Op.F) == (a.op is Op.SEND_F)


def test_insert_comm_rejects_comm_input():
    with pytest.raises(ConfigError, match="compute-only"):
        insert_comm(insert_comm(one_f_one_b(2, 2)))


@pytest.mark.parametrize("name,S,N,frag", [
    ("pipedream", 2, 2, "schedule 'pipedream' is unknown"),
    ("1f1b", 0, 4, "num_stages must be an integer >= 1, got 0"),
    ("gpipe", 2, 0, "num_microbatches must be an integer >= 1, got 0"),
    ("zb", 3, -1, "num_microbatches must be an integer >= 1, got -1"),
])
def test_generate_rejects_bad_input(name, S, N, frag):
    with pytest.raises(ConfigError, match=frag):
        generate(name, S, N)


# ---- rejections --------------------------------------------------------------------------

def _zb(S=3, N=4):
    return generate("zb", S, N)


def test_rejects_missing_op():
    s = _zb()
    s[1].remove(A("W3"))
    with pytest.raises(ScheduleError, match="stage 1 is missing W3"):
        validate_schedule(s, 3, 4)


def test_rejects_duplicated_op():
    s = _zb()
    s[2].append(A("F0"))
    with pytest.raises(ScheduleError, match=r"stage 2 action F0 appears twice \(positions 0 and 12\)"):
        validate_schedule(s, 3, 4)


def test_rejects_w_before_b():
    s = _zb()
    row = s[0]
    i, j = row.index(A("B2")), row.index(A("W2"))
    row[i], row[j] = row[j], row[i]
    with pytest.raises(ScheduleError, match="stage 0 action W2 .* runs before B2"):
        validate_schedule(s, 3, 4)


def test_rejects_backward_before_forward():
    s = one_f_one_b(2, 2)
    s[1] = [A("BW0"), A("F0"), A("F1"), A("BW1")]
    with pytest.raises(ScheduleError, match="stage 1 action BW0 .* runs before F0"):
        validate_schedule(s, 2, 2)


def test_rejects_send_to_non_adjacent_stage():
    s = insert_comm(one_f_one_b(3, 2))
    s[0][s[0].index(A("SF0>1"))] = A("SF0>2")
    with pytest.raises(ScheduleError, match="stage 0 action SF0>2: sends only to adjacent stages"):
        validate_schedule(s, 3, 2)


def test_rejects_send_in_wrong_direction():
    s = insert_comm(one_f_one_b(3, 2))
    s[1][s[1].index(A("SF0>2"))] = A("SF0>0")
    with pytest.raises(ScheduleError, match="stage 1 action SF0>0: SF must name stage 2, not 0"):
        validate_schedule(s, 3, 2)


def test_rejects_unmatched_send():
    s = insert_comm(one_f_one_b(2, 2))
    s[1].remove(A("RF1<0"))
    with pytest.raises(ScheduleError, match="stage 0 action SF1>1: unmatched send, no RF1<0 on stage 1"):
        validate_schedule(s, 2, 2)


def test_rejects_misplaced_comm():
    s = insert_comm(one_f_one_b(2, 2))
    row = s[0]
    i, j = row.index(A("F0")), row.index(A("SF0>1"))
    row[i], row[j] = row[j], row[i]
    with pytest.raises(ScheduleError, match="stage 0 action SF0>1 .* must come after F0"):
        validate_schedule(s, 2, 2)


def test_rejects_link_order_swap():
    # stage 1 runs F2 before F1 (a legal compute order) but stage 0 still sends 1 before 2
    s = sched("0: F0 SF0>1 F1 SF1>1 F2 SF2>1 RB0<1 BW0 RB1<1 BW1 RB2<1 BW2\n"
              "1: RF0<0 F0 RF2<0 F2 RF1<0 F1 BW0 SB0>0 BW1 SB1>0 BW2 SB2>0")
    with pytest.raises(ScheduleError, match="link 0->1: send order differs from receive order at message 1: "
                                            "stage 0 sends SF1 but stage 1 receives RF2"):
        validate_schedule(s, 2, 3)


def test_rejects_quota_exceeded():
    s = one_f_one_b(4, 8)
    validate_schedule(s, 4, 8, warmup_quota=[4, 3, 2, 1])
    with pytest.raises(ScheduleError, match=r"stage 0 action F3 \(position 3\): 4 activations in flight "
                                            "exceeds warm-up quota 3"):
        validate_schedule(s, 4, 8, warmup_quota=[3, 2, 1, 1])
    with pytest.raises(ScheduleError, match="exceeds memory limit 2"):
        validate_schedule(s, 4, 8, memory_limit=[2, 2, 2, 2])


def test_rejects_quota_above_num_microbatches():
    with pytest.raises(ScheduleError, match="warm-up quota 30 on stage 0 exceeds num_microbatches 24"):
        validate_schedule(one_f_one_b(2, 24), 2, 24, warmup_quota=[30, 1])


def test_rejects_deadlock_compute_only():
    # stage 0 waits for BW0 from stage 1, which first needs F1 that stage 0 only sends later
    s = sched("0: F0 BW0 F1 BW1\n1: F1 BW1 F0 BW0")
    with pytest.raises(ScheduleError, match="deadlock .*stage 0 waits at BW0 .*stage 1 waits at F1"):
        validate_schedule(s, 2, 2)


def test_rejects_deadlock_with_comm():
    # stage 0 waits for the gradient of micro-batch 0 before sending its activation
    s = sched("0: F0 RB0<1 SF0>1 BW0\n1: RF0<0 F0 BW0 SB0>0")
    with pytest.raises(ScheduleError, match=r"deadlock \(buffered sends\).*stage 0 waits at RB0<1 \(position 1\)"):
        validate_schedule(s, 2, 1)


def test_blocking_sends_need_parity_order():
    # both stages send before receiving: fine with buffered sends, deadlock when sends block
    s = sched("0: F0 SF0>1 F1 SF1>1 RB0<1 BW0 RB1<1 BW1\n"
              "1: RF0<0 F0 BW0 SB0>0 RF1<0 F1 BW1 SB1>0")
    validate_schedule(s, 2, 2)
    with pytest.raises(ScheduleError, match=r"deadlock \(blocking sends\).*stage 0 waits at SF1>1.*"
                                            "stage 1 waits at SB0>0"):
        validate_schedule(s, 2, 2, blocking_sends=True)


@pytest.mark.parametrize("text,S,N,frag", [
    ("0: F0 BW0", 2, 1, r"schedule has stages \[0\], expected 0..1"),
    ("0: F0 F1 BW0 BW1", 1, 1, "micro-batch 1 out of range for num_microbatches 1"),
    ("0: F0 B0 W0 F1 BW1", 1, 2, "mixes split backward"),
    ("0: F0 BW0", 1, 1, "split_backward=True but the schedule uses fused BW"),
])
def test_rejects_malformed(text, S, N, frag):
    kw = {"split_backward": True} if "split_backward" in frag else {}
    with pytest.raises(ScheduleError, match=frag):
        validate_schedule(sched(text), S, N, **kw)


def test_schedule_error_is_a_config_error():
    assert issubclass(ScheduleError, ConfigError)
