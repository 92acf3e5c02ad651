"""Record store: schema, atomic writes, concurrent appends, redaction."""
from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest

from bench import provenance
from bench.record import RecordError, load_records, new_run_id, now_iso, validate, write_record
from impl.common.api import Metric


def make_record(system="sys_a", **over):
    rec = {
        "schema": "mlsys-bench.record/1", "run_id": new_run_id(system), "created": now_iso(),
        "status": "ok", "error": None, "experiment": "exp", "system": system, "mode": "sim",
        "workload": "w", "hardware": "h", "fault": "none", "seed": 0,
        "metrics": {"iteration_time_s": Metric.from_samples([1.0, 2.0, 3.0], "s").to_dict()},
        "provenance": {"git": {"commit": None, "dirty": None}, "packages": {}, "host": {}, "devices": [],
                       "container_image": None, "emulated": []},
        "config": {}, "overrides": [], "wandb": None,
    }
    rec.update(over)
    return rec


@pytest.mark.parametrize("field, value, where", [
    ("status", "great", "status"),
    ("mode", "fast", "mode"),
    ("error", "two\nlines", "error"),
    ("metrics", {"t": {"value": 1.0}}, "metrics/t"),
])
def test_schema_rejects_naming_the_field(field, value, where):
    with pytest.raises(RecordError, match=f"record field {where}"):
        validate(make_record(**{field: value}))


def test_missing_required_key_rejected():
    rec = make_record()
    del rec["provenance"]
    with pytest.raises(RecordError, match="provenance"):
        validate(rec)


def test_write_is_atomic_and_round_trips(tmp_path):
    rec = make_record()
    path = write_record(tmp_path, rec)
    assert json.loads(path.read_text()) == rec
    assert [p.name for p in path.parent.iterdir()] == ["record.json"], "no temp file left behind"
    assert load_records(tmp_path) == [rec]


def test_invalid_record_writes_nothing(tmp_path):
    with pytest.raises(RecordError):
        write_record(tmp_path, make_record(status="nope"))
    assert not (tmp_path / "records.jsonl").exists()


def test_nan_metric_refused(tmp_path):
    rec = make_record(metrics={"t": {**Metric.scalar(1.0, "s").to_dict(), "value": float("nan")}})
    with pytest.raises(ValueError):
        write_record(tmp_path, rec)


def _writer(args):
    results_dir, worker, count = args
    for i in range(count):
        # Large records make torn lines likely if appends were not atomic.
        write_record(results_dir, make_record(system=f"w{worker}", seed=i, config={"pad": "x" * 20000}))


def test_concurrent_appends_never_tear_lines(tmp_path):
    ctx = mp.get_context("spawn")
    with ctx.Pool(4) as pool:
        pool.map(_writer, [(str(tmp_path), w, 25) for w in range(4)])
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert len(lines) == 100
    recs = [json.loads(line) for line in lines]
    assert sorted((r["system"], r["seed"]) for r in recs) == sorted((f"w{w}", i) for w in range(4) for i in range(25))


def test_malformed_jsonl_line_named(tmp_path):
    write_record(tmp_path, make_record())
    with open(tmp_path / "records.jsonl", "a") as fh:
        fh.write("{torn\n")
    with pytest.raises(RecordError, match=r"records.jsonl:2"):
        load_records(tmp_path)


def test_redact_scrubs_secret_keys_and_env_values(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "s3cr3t-value-123")
    cfg = {"logger": {"api_key": "abc123", "name": "wandb"}, "note": "uses s3cr3t-value-123 inline",
           "tokenizer": "gpt2", "nested": [{"password": "hunter22"}], "max_new_tokens": 5}
    out = provenance.redact(cfg)
    assert out["logger"]["api_key"] == provenance.REDACTED
    assert out["note"] == f"uses {provenance.REDACTED} inline"
    assert out["tokenizer"] == "gpt2" and out["max_new_tokens"] == 5
    assert out["nested"][0]["password"] == provenance.REDACTED


def test_provenance_carries_no_environment(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "planted-provenance-secret")
    prov = provenance.collect()
    assert "planted-provenance-secret" not in json.dumps(prov)
    assert set(prov) == {"git", "packages", "host", "devices", "container_image", "emulated"}
    assert prov["packages"]["torch"].startswith("2.13.0")
