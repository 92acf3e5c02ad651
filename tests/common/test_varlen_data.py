"""Length distributions, histogram loader and per-step sampling of the varlen substrate."""
from __future__ import annotations

import math

import numpy as np
import pytest

from impl.common.api import ConfigError
from impl.common.varlen import LengthDist, LengthStream, commoncrawl, github, hotspa_cpu, load_histogram, preset
from impl.common.varlen.lengths import write_histogram


def test_presets_match_their_definitions():
    rng = np.random.default_rng(0)
    cc = commoncrawl(32768).sample(40000, rng)
    assert abs(np.median(cc) / 700 - 1) < 0.04
    # The stand-in puts ~97% of CommonCrawl sequences below 8K, as Hetu v2 / HSPMD (OSDI'26) Fig. 18 reports (exact: Phi(ln(8192/700)/1.25)).
    expected = 0.5 * (1 + math.erf(math.log(8192 / 700) / 1.25 / math.sqrt(2)))
    assert abs((cc < 8192).mean() - expected) < 0.005 and 0.96 < expected < 0.98
    gh = github(16384).sample(40000, rng)
    assert abs(np.median(gh) / 1800 - 1) < 0.04 and gh.max() <= 16384
    cpu = hotspa_cpu().sample(40000, rng)
    assert cpu.min() >= 16 and cpu.max() == 2048  # clipped, and the clip is reached
    assert abs(np.log(cpu[(cpu > 16) & (cpu < 2048)]).std() - 1.0) < 0.1
    assert preset("github", 4096).max_len == 4096


def test_sampling_is_bit_reproducible_and_independent_of_step_cuts():
    a = LengthStream(hotspa_cpu(), seed=7)
    b = LengthStream(hotspa_cpu(), seed=7)
    steps_a = [a.by_count(10), a.by_count(1500), a.by_count(3)]
    whole = b.by_count(1513)
    assert np.array_equal(np.concatenate([s.lengths for s in steps_a]), whole.lengths)
    assert np.array_equal(np.concatenate([s.ids for s in steps_a]), np.arange(1513))
    assert [s.step for s in steps_a] == [0, 1, 2]
    assert not np.array_equal(LengthStream(hotspa_cpu(), seed=8).by_count(50).lengths, whole.lengths[:50])


@pytest.mark.parametrize("overflow", ["keep", "defer"])
def test_token_budget_never_truncates_or_drops(overflow):
    for seed in range(20):
        s = LengthStream(commoncrawl(8192), seed)
        budget = 20000
        next_id = 0
        for _ in range(5):
            step = s.by_tokens(budget, overflow)
            assert step.ids[0] == next_id  # contiguous: nothing skipped between steps
            next_id = int(step.ids[-1]) + 1
            total = step.num_tokens
            if overflow == "keep":
                assert budget <= total < budget + step.lengths[-1]
            else:
                assert total <= budget or len(step) == 1
                assert total + s._buf[s._pos] > budget  # the next one would overflow: deferred
    # A sequence longer than the budget still forms its own step under "defer".
    s = LengthStream(LengthDist(median=5000, sigma=0.0), 0)
    step = s.by_tokens(100, "defer")
    assert list(step.lengths) == [5000]


def test_no_clip_reports_the_numbers():
    d = LengthDist(median=1000, sigma=1.0, max_len=2048, clip=False)
    with pytest.raises(ConfigError, match=r"drew length \d+ > max_len 2048 with clip false"):
        d.sample(1000, np.random.default_rng(0))


def test_bad_distribution_fields():
    with pytest.raises(ConfigError, match="workload.lengths.sigma: must be a finite number >= 0, got -1"):
        LengthDist(sigma=-1).validate()
    with pytest.raises(ConfigError, match="max_len: 8 must be 0 .* >= min_len 16"):
        LengthDist(min_len=16, max_len=8).validate()
    with pytest.raises(ConfigError, match="kind: unknown kind 'zipf'"):
        LengthDist(kind="zipf").validate()
    with pytest.raises(ConfigError, match="unknown preset 'books'"):
        preset("books", 4096)


def test_histogram_round_trip_and_sampling(tmp_path):
    path = tmp_path / "h.csv"
    write_histogram(path, np.array([100, 200, 4000]), np.array([6, 3, 1]))
    lengths, counts = load_histogram(str(path))
    assert list(lengths) == [100, 200, 4000] and list(counts) == [6, 3, 1]
    d = LengthDist(kind="histogram", path=str(path))
    x = d.sample(20000, np.random.default_rng(1))
    assert set(np.unique(x)) == {100, 200, 4000}
    assert abs((x == 100).mean() - 0.6) < 0.02 and abs((x == 4000).mean() - 0.1) < 0.01
    clipped = LengthDist(kind="histogram", path=str(path), max_len=2048, clip=True).sample(
        1000, np.random.default_rng(1))
    assert clipped.max() == 2048
    with pytest.raises(ConfigError, match=r"h.csv:4: length 4000 is outside workload.lengths limits \[1, 2048\]"):
        LengthDist(kind="histogram", path=str(path), max_len=2048, clip=False).sample(10, np.random.default_rng(1))


@pytest.mark.parametrize("body,message", [
    ("length,count\n100,-3\n", r":2: field count must be >= 0, got -3"),
    ("length,count\n100,2.5\n", r":2: field count is not an integer: '2.5'"),
    ("100,2\nabc,1\n", r":2: field length is not an integer: 'abc'"),
    ("# lengths\n100,2\n0,1\n", r":3: field length must be >= 1, got 0"),
    ("100,2\n200\n", r":2: expected 2 fields 'length,count', got 1"),
    ("100,2\n100,5\n", r":2: field length 100 repeats line 1"),
    ("length,count\n\n# nothing\n", r"has no 'length,count' rows"),
    ("100,0\n200,0\n", r"counts sum to 0 over 2 rows"),
])
def test_histogram_bad_rows(tmp_path, body, message):
    path = tmp_path / "bad.csv"
    path.write_text(body)
    with pytest.raises(ConfigError, match=message) as e:
        load_histogram(str(path))
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_histogram_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read histogram file"):
        load_histogram(str(tmp_path / "none.csv"))
