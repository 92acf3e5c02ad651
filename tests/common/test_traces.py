"""Request traces: seeded generators, file round trips, one-line errors for bad rows."""
from __future__ import annotations

import numpy as np
import pytest

from impl.common.api import ConfigError
from impl.common.traces import (TraceSpec, gamma_arrivals, generate_trace, load_trace, poisson_arrivals, save_trace,
                                zipf_popularity)


def test_same_seed_same_trace_and_basic_statistics():
    spec = TraceSpec(num_requests=4000, rate_rps=5.0, num_adapters=50, zipf_alpha=1.2)
    a, b = generate_trace(spec, 3), generate_trace(spec, 3)
    assert a.requests == b.requests and a.adapters == b.adapters
    assert generate_trace(spec, 4).requests != a.requests
    gaps = np.diff([0.0] + [r.arrival_s for r in a.requests])
    assert abs(gaps.mean() - 0.2) < 0.02
    pl = np.array([r.prompt_len for r in a.requests])
    assert abs(np.median(pl) - 60) < 6 and pl.min() >= 4 and pl.max() <= 2048
    counts = sorted(np.unique([r.adapter for r in a.requests], return_counts=True)[1], reverse=True)
    assert counts[0] > 5 * counts[len(counts) // 2]  # Zipf: a hot head
    assert set(a.adapters.values()) <= {8, 16, 32, 64}


def test_gamma_bursts_have_requested_cv():
    rng = np.random.default_rng(0)
    gaps = np.diff(np.concatenate([[0.0], gamma_arrivals(4.0, 3.0, 20000, rng)]))
    assert abs(gaps.mean() - 0.25) < 0.03
    assert abs(gaps.std() / gaps.mean() - 3.0) < 0.4
    assert len(poisson_arrivals(1.0, 10, rng)) == 10
    p = zipf_popularity(4, 0.0)
    assert np.allclose(p, 0.25)


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_file_round_trip(tmp_path, suffix):
    t = generate_trace(TraceSpec(num_requests=30, num_adapters=5), 1)
    path = save_trace(t, tmp_path / f"t{suffix}")
    back = load_trace(path)
    assert back.requests == t.requests
    assert {a: back.adapters[a] for a in back.adapters} == {a: t.adapters[a] for a in back.adapters}


@pytest.mark.parametrize("row,msg", [
    ("0.5,lora-1,abc,4", "t.csv line 3: field 'prompt_len': expected a positive integer, got 'abc'"),
    ("0.5,lora-1,12,-2", "t.csv line 3: field 'output_len': expected a positive integer, got '-2'"),
    ("x,lora-1,12,4", "t.csv line 3: field 'arrival_s': expected a finite number >= 0, got 'x'"),
    (",lora-1,12,4", "t.csv line 3: field 'arrival_s' is missing"),
    ("0.5,lora-9,12,4", "t.csv line 3: field 'adapter': unknown adapter id 'lora-9'"),
    ("0.01,lora-1,12,4", "t.csv line 3: field 'arrival_s': 0.01 is earlier than the previous row (0.1)"),
])
def test_malformed_csv_row_is_one_line(tmp_path, row, msg):
    p = tmp_path / "t.csv"
    p.write_text("arrival_s,adapter,prompt_len,output_len\n0.1,lora-1,10,5\n" + row + "\n")
    with pytest.raises(ConfigError) as exc:
        load_trace(p, {"lora-1": 16})
    assert str(exc.value) == msg and "\n" not in str(exc.value)


def test_malformed_jsonl(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"adapters": {"a": 8}}\n{"arrival_s": 0, "adapter": "a", "prompt_len": 3, "output_len": 2}\n{oops\n')
    with pytest.raises(ConfigError, match=r"^t.jsonl line 3: not valid JSON"):
        load_trace(p)
    p.write_text('{"adapters": {"a": 8}}\n{"arrival_s": 0, "adapter": "a", "prompt_len": 3.5, "output_len": 2}\n')
    with pytest.raises(ConfigError, match=r"^t.jsonl line 2: field 'prompt_len': expected a positive integer"):
        load_trace(p)


def test_unknown_adapter_in_generated_trace_is_rejected():
    t = generate_trace(TraceSpec(num_requests=5, num_adapters=2), 0)
    del t.adapters[t.requests[0].adapter]
    with pytest.raises(ConfigError, match=r"trace request 0: unknown adapter id 'lora-0000\d'"):
        t.validate()
    t2 = generate_trace(TraceSpec(num_requests=5, num_adapters=3, ranks=[8], rank_weights=[1.0]), 0)
    with pytest.raises(ConfigError, match="rank 8 is not supported by the Punica BGMV kernel"):
        t2.validate((16, 32, 64), "Punica BGMV")
