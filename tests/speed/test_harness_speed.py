"""Hot paths of the harness, timed with pytest-benchmark (`--benchmark-enable` to time them).

With the repo's default `--benchmark-disable` each runs once, as a plain correctness test.
"""
from __future__ import annotations

import json

import pytest

from bench.compare import compare_records
from bench.record import JSONL_NAME, load_records, write_record

N = 2000
SYSTEMS = ("adaptra", "zb", "1f1b", "uniform")


def metric(value, unit="s", better="lower"):
    return {"value": value, "unit": unit, "better": better, "n": 20, "p50": value,
            "p10": value * 0.95, "p90": value * 1.05}


def typical_record(i: int) -> dict:
    """A record the size of a real pipeline job: a handful of metrics, a resolved config."""
    system = SYSTEMS[i % len(SYSTEMS)]
    return {"schema": "mlsys-bench.record/1", "run_id": f"20260101T000000-{system}-{i:06x}",
            "created": f"2026-01-01T00:{(i // 60) % 60:02d}:{i % 60:02d}+00:00",
            "status": "failed" if i % 50 == 7 else "ok", "error": None, "experiment": "exp",
            "system": system, "mode": "sim" if i % 2 else "real",
            "workload": f"gpt{(i // 8) % 5}", "hardware": "h800", "fault": "link_delay",
            "seed": i, "sweep": f"sweep-{i // 500}",
            "metrics": {"iteration_time_s": metric(0.4 + i % 7 * 0.01),
                        "throughput_samples_per_s": metric(60.0 + i % 5, "samples/s", "higher"),
                        "bubble_fraction": metric(0.08, "fraction"),
                        "peak_memory_bytes": metric(2.0e9, "B")},
            "provenance": {"git": {"commit": "0" * 40, "dirty": False},
                           "packages": {"torch": "2.13.0", "hydra-core": "1.3.8"},
                           "host": {"hostname": "ci", "cpus": 2}, "devices": [],
                           "container_image": None, "emulated": []},
            "config": {"system": {"name": system, "schedule": system, "queue_depth": 1},
                       "workload": {"stages": 4, "num_microbatches": 12, "dtype": "fp32"},
                       "hardware": {"name": "h800", "peak_flops": {"bf16": 9.89e14}}},
            "overrides": [f"system={system}"], "wandb": None, "artifacts": ["timeline.png"]}


@pytest.fixture(scope="module")
def records():
    return [typical_record(i) for i in range(N)]


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory, records):
    # Written as the harness does it: one line per record in records.jsonl (the per-run
    # record.json files are not needed for the jsonl read path and would slow the setup).
    d = tmp_path_factory.mktemp("runs")
    with open(d / JSONL_NAME, "w") as fh:
        fh.writelines(json.dumps(r, sort_keys=True) + "\n" for r in records)
    return d


def test_write_record(benchmark, tmp_path):
    counter = iter(range(10**9))

    def write():
        rec = typical_record(next(counter))
        return write_record(tmp_path, rec)

    path = benchmark(write)
    assert json.loads(path.read_text())["run_id"] == path.parent.name
    n_lines = len((tmp_path / JSONL_NAME).read_text().splitlines())
    assert n_lines == len(list(tmp_path.glob("*/record.json")))


def test_load_records_2000(benchmark, results_dir):
    loaded = benchmark(load_records, results_dir)
    assert len(loaded) == N and loaded[-1]["run_id"] == typical_record(N - 1)["run_id"]


def test_compare_records_2000(benchmark, records):
    tables = benchmark(compare_records, records, "zb")
    ok = [r for r in records if r["status"] == "ok"]
    groups = {(r["experiment"], r["workload"], r["hardware"], r["fault"], r["mode"])
              for r in records}
    assert len(tables) == len(groups)
    shown = sum(len(t.rows) for t in tables)
    superseded = sum(row.superseded for t in tables for row in t.rows)
    assert shown + superseded == len(ok)  # every ok record is shown or counted as older
    assert sum(sum(t.excluded.values()) for t in tables) == N - len(ok)
