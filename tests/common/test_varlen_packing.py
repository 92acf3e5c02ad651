"""Packing rules, grouping and DP assignment: HotSPa's invariants over many seeds."""
from __future__ import annotations

import numpy as np
import pytest

from impl.common.api import ConfigError
from impl.common.varlen import (LengthStream, MicroBatch, assign_dp, check_packing, commoncrawl,
                                equal_count, greedy_pack, group_by_boundaries, hotspa_cpu, hotspa_pack, largest_first,
                                pad_to_max)

SEEDS = range(40)


def _step(seed, n=64, dist=None):
    return LengthStream(dist or hotspa_cpu(), seed).by_count(n)


def _hotspa_reference(lengths, bound):
    """HotSPa's packing rule written the slow, literal way: indices per micro-batch."""
    unused = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    out = []
    while unused:
        mb = [unused.pop()]
        while unused and sum(lengths[i] for i in mb) + lengths[unused[0]] <= bound:
            mb.append(unused.pop(0))
        out.append(mb)
    return out


def _greedy_reference(lengths, cap):
    """Hydraulis's greedy packing written literally: shortest opens a bin, then scan longest-first adding what fits."""
    unused = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    out = []
    while unused:
        mb = [unused.pop(0)]
        room = cap - lengths[mb[0]]
        for i in list(reversed(unused)):
            if lengths[i] <= room:
                mb.append(i)
                unused.remove(i)
                room -= lengths[i]
        out.append(mb)
    return out


def test_hotspa_pipeline_invariants_over_seeds():
    """Group -> HotSPa-pack -> DP assignment: every sequence in exactly one group, micro-batch
    and rank; no bound exceeded; aligned padding within the bound; equal counts per rank."""
    boundaries = [2048, 1024, 256, 0]
    for seed in SEEDS:
        step = _step(seed)
        groups = group_by_boundaries(step.ids, step.lengths, boundaries)
        by_group = [set(g.seq_ids) for g in groups]
        assert sum(len(s) for s in by_group) == len(step) and set().union(*by_group) == set(step.ids.tolist())
        for dp in (1, 2, 3):
            rank_of: dict[int, int] = {}
            all_mbs = []
            for g in groups:
                assert all(g.lower < x <= g.upper for x in g.lengths)
                assert list(g.lengths) == sorted(g.lengths, reverse=True)
                mbs = hotspa_pack(g.seq_ids, g.lengths, g.upper, pad="align", align=128)
                if g.is_empty:
                    assert mbs == []
                check_packing(g.seq_ids, g.lengths, mbs)
                for mb in mbs:
                    assert mb.num_tokens <= g.upper and mb.padded_len <= g.upper
                    assert mb.padded_len % 128 == 0 and mb.padded_len - mb.num_tokens < 128
                    assert mb.cu_seqlens.dtype == np.int32 and mb.cu_seqlens[-1] == mb.num_tokens
                    assert mb.max_seqlen == max(mb.lengths)
                ranks = assign_dp(mbs, dp)
                assert len({len(r) for r in ranks}) == 1 and sum(len(r) for r in ranks) >= len(mbs)
                assert sum(not mb.is_empty for r in ranks for mb in r) == len(mbs)
                for i, mb in enumerate(mbs):
                    assert ranks[i % dp][i // dp] is mb
                for r, rank in enumerate(ranks):
                    for mb in rank:
                        for sid in mb.seq_ids:
                            assert sid not in rank_of
                            rank_of[sid] = r
                all_mbs += mbs
            assert set(rank_of) == set(step.ids.tolist())
            check_packing(step.ids, step.lengths, all_mbs)


def test_hotspa_pack_matches_the_literal_rule():
    for seed in SEEDS:
        step = _step(seed, dist=commoncrawl(8192))
        lengths = step.lengths.tolist()
        got = hotspa_pack(step.ids, step.lengths, 8192, pad="none")
        want = _hotspa_reference(lengths, 8192)
        assert [list(mb.seq_ids) for mb in got] == [[int(step.ids[i]) for i in mb] for mb in want]


def test_greedy_pack_matches_the_literal_rule_and_leaves_no_room_unused():
    for seed in SEEDS:
        step = _step(seed, n=100)
        lengths = step.lengths.tolist()
        got = greedy_pack(step.ids, step.lengths, 2048, pad="none")
        want = _greedy_reference(lengths, 2048)
        assert [sorted(mb.seq_ids) for mb in got] == [sorted(int(step.ids[i]) for i in mb) for mb in want]
        check_packing(step.ids, step.lengths, got)
        ordered = largest_first(got)
        assert [mb.num_tokens for mb in ordered] == sorted((mb.num_tokens for mb in got), reverse=True)
        packed = set()
        for mb in got:
            packed |= set(mb.seq_ids)
            rest = [x for i, x in zip(step.ids, lengths) if int(i) not in packed]
            # A bin closes only when no unused sequence fits its room.
            assert not rest or min(rest) > 2048 - mb.num_tokens


def test_equal_count_and_pad_to_max():
    for seed in SEEDS:
        step = _step(seed, n=37)
        mbs = equal_count(step.ids, step.lengths, 4)
        assert [mb.num_seqs for mb in mbs] == [10, 9, 9, 9]
        assert [i for mb in mbs for i in mb.seq_ids] == step.ids.tolist()  # order kept
        rows = pad_to_max(step.ids, step.lengths, micro_batch_size=8)
        check_packing(step.ids, step.lengths, rows)
        top = int(step.lengths.max())
        assert [mb.num_seqs for mb in rows] == [8, 8, 8, 8, 5]
        for mb in rows:
            assert mb.row_len == top and mb.padded_len == mb.num_seqs * top
            assert mb.cu_seqlens.tolist() == [top * k for k in range(mb.num_seqs + 1)]
    assert equal_count([1, 2], [5, 6], 4) and len(equal_count([1, 2], [5, 6], 4)) == 2
    assert equal_count([], [], 3) == [] and pad_to_max([], [], 2) == []
    with pytest.raises(ConfigError, match="equal-count micro-batch of 2 sequences holds 11 tokens > capacity 10"):
        equal_count([1, 2], [5, 6], 1, capacity=10)


def test_pad_modes():
    mbs = hotspa_pack([0, 1, 2], [300, 500, 100], 1024, pad="bound", align=128)
    assert [mb.padded_len for mb in mbs] == [1024]
    assert hotspa_pack([0, 1], [300, 500], 1024, pad="none")[0].padded_len == 800
    assert hotspa_pack([0, 1], [300, 500], 1024, pad="align", align=128)[0].padded_len == 896
    with pytest.raises(ConfigError, match="packing.align: capacity 1000 is not a multiple of align 128"):
        hotspa_pack([0], [10], 1000, align=128)
    with pytest.raises(ConfigError, match="packing.pad: unknown mode 'max'"):
        greedy_pack([0], [10], 1024, pad="max")


def test_too_long_sequences_and_bad_boundaries_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"boundaries: sequence 7 of length 5000 is longer than the largest "
                                          r"boundary 4096 of \[4096, 1024, 0\]"):
        group_by_boundaries([3, 7], [100, 5000], [4096, 1024, 0])
    with pytest.raises(ConfigError, match=r"boundaries: boundaries must be strictly descending, but "
                                          r"boundaries\[1\]=1024 <= boundaries\[2\]=4096 in \[32768, 1024, 4096, 0\]"):
        group_by_boundaries([0], [10], [32768, 1024, 4096, 0])
    with pytest.raises(ConfigError, match=r"not above the lowest boundary 16"):
        group_by_boundaries([0], [16], [2048, 16])
    with pytest.raises(ConfigError, match=r"need at least 2 boundaries"):
        group_by_boundaries([0], [16], [2048])
    for fn in (hotspa_pack, greedy_pack):
        with pytest.raises(ConfigError, match="sequence 9 of length 3000 exceeds the micro-batch capacity 2048"):
            fn([1, 9], [10, 3000], 2048)
    with pytest.raises(ConfigError, match="sequence ids repeat"):
        hotspa_pack([1, 1], [10, 20], 2048)


def test_empty_groups_and_dp_padding():
    groups = group_by_boundaries([0, 1, 2], [50, 60, 3000], [4096, 1024, 256, 0])
    assert [len(g.seq_ids) for g in groups] == [1, 0, 2] and groups[1].is_empty
    assert hotspa_pack(groups[1].seq_ids, groups[1].lengths, groups[1].upper) == []
    assert assign_dp([], 4) == [[], [], [], []]
    mbs = [MicroBatch((i,), (10,), 10, 128) for i in range(5)]
    ranks = assign_dp(mbs, 2)
    assert [[mb.seq_ids for mb in r] for r in ranks] == [[(0,), (2,), (4,)], [(1,), (3,), ()]]
    pad = ranks[1][2]
    assert pad.is_empty and pad.num_tokens == 0 and pad.padded_len == 0 and pad.cu_seqlens.tolist() == [0]


def test_check_packing_catches_violations():
    good = hotspa_pack([0, 1, 2], [100, 200, 300], 512, pad="none")
    check_packing([0, 1, 2], [100, 200, 300], good)
    with pytest.raises(ValueError, match="1 sequences in no micro-batch"):
        check_packing([0, 1, 2, 3], [100, 200, 300, 5], good)
    with pytest.raises(ValueError, match="sequence 2 is in micro-batches 0 and 2"):
        check_packing([0, 1, 2], [100, 200, 300], good + good[:1])
    with pytest.raises(ValueError, match="holds 600 tokens > bound 512"):
        check_packing([0, 1, 2], [100, 200, 300], [MicroBatch((0, 1, 2), (100, 200, 300), 600, 512)])
