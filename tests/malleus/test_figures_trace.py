"""impl.malleus.figures: an interleaved real run is drawn as one series per plan."""
from __future__ import annotations

from impl.malleus.figures import iteration_trace, trace_series


def interleaved_record():
    plans = ["uniform", "data_only", "layers_only", "malleus"]
    return {"system": "malleus", "status": "ok", "mode": "real",
            "info": {"iteration_times_s": [3.0, 2.9] + [float(i) for i in range(8)]},
            "config": {"system": {"interleave": plans}, "workload": {"warmup_iterations": 2}}}


def test_interleaved_run_splits_by_plan():
    series = trace_series(interleaved_record())
    assert list(series) == ["warm-up (uniform)", "uniform", "data_only", "layers_only", "malleus"]
    assert series["warm-up (uniform)"] == ([0, 1], [3.0, 2.9])
    assert series["uniform"] == ([2, 6], [0.0, 4.0]) and series["malleus"] == ([5, 9], [3.0, 7.0])


def test_plain_run_is_one_series_named_by_its_system(tmp_path):
    rec = {"system": "uniform", "status": "ok", "mode": "sim", "info": {"iteration_times_s": [1.0, 2.0]},
           "config": {"system": {}}}
    assert trace_series(rec) == {"uniform": ([0, 1], [1.0, 2.0])}
    (path,) = iteration_trace([rec, interleaved_record()], tmp_path)
    assert path.is_file()
