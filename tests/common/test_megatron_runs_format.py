"""Any runs file of the February format: buckets and the top label read from the file (a 32K
sweep with ``>32k``), a launch that printed no layout skipped and counted, other bad histogram
values one line naming line and field. Small hand-made files, no shipped data."""
from __future__ import annotations

import json

import numpy as np
import pytest

from bench.megatron_runs import main
from impl.common.api import ConfigError
from impl.common.megatron.runs import DocLengths, load_runs

BOUNDS = [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]


def _launch(i: int, ctx: int, mode: str = "pack", status: str = "ok", hist=None, **eff) -> dict:
    e = {"arch": "gpt", "model": "tiny", "gpus": 8, "seq_length": ctx, "gbs": 16, "mbs": 1, "dp": 8, "tp": 1, "pp": 1,
         "mode": mode, "sequence_parallel": False, "recompute": None, **eff}
    cfg = {"num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 1024, "num_attention_heads": 4,
           "tokenizer_vocab_size": 1000, "max_position_embeddings": ctx, "train_iters": 20}
    rec = {"id": f"run{i}", "status": status, "effective": e, "config": cfg,
           "iterations": [{"iteration": 10, "elapsed_ms": 900.0}, {"iteration": 20, "elapsed_ms": 800.0}],
           "summary": {"median_ms_excl_first": 800.0 + i}, "max_allocated_mb_max_over_ranks": 2000.0 + i,
           "memory_per_rank": [{"rank": 0, "max_allocated_mb": 2000.0 + i}]}
    if hist is not None:
        rec["seq_len_histogram"] = {"rank0_or_first": {"real_seq_len": hist}}
    return rec


def _hist32k() -> dict:
    h = {str(b): 10 + j for j, b in enumerate(BOUNDS)}
    h[">32k"] = 7
    return h


def _write(tmp_path, recs, name="runs.jsonl"):
    f = tmp_path / name
    f.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in recs))
    return f


def test_histograms_reaching_32k_with_a_32k_top_bucket(tmp_path):
    recs = [_launch(0, 32768, hist=_hist32k()), _launch(1, 32768, mode="pad"), _launch(2, 16384, hist=_hist32k())]
    f = _write(tmp_path, recs)
    launches = load_runs(f)
    h = launches[0].histogram
    assert h[32768] == 18 and h[">32k"] == 7 and 16384 in h
    docs = DocLengths(launches)
    lengths = docs.sample(launches[0], 4, np.random.default_rng(0))
    assert lengths.max() <= 32768 and (lengths > 16384).any()  # the 32K bucket is drawn from
    assert 0 < docs.cut_share(32768) <= 1 and 0 < docs.cut_share(16384) <= 1
    assert main(["--runs", str(f), "--out", str(tmp_path / "out"), "--hardware", "h100-megatron"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["priced"] == 3 and summary["skipped_no_layout"] == 0


def test_launch_without_layout_is_skipped_and_counted(tmp_path, capsys):
    no_layout = _launch(9, 4096, status="error")
    no_layout["effective"] = {**{k: None for k in no_layout["effective"]}, "model": "tiny"}
    del no_layout["config"]
    recs = [_launch(0, 4096, mode="pad"), no_layout, _launch(1, 4096, mode="pad", mbs=2)]
    f = _write(tmp_path, recs)
    launches = load_runs(f)
    assert [la.no_layout for la in launches] == [False, True, False] and launches[1].layout is None
    assert main(["--runs", str(f), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "1 launches printed no layout (effective.mode null, status error): skipped" in out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["launches"] == 3 and summary["priced"] == 2 and summary["skipped_no_layout"] == 1


@pytest.mark.parametrize("hist,field", [
    ({**_hist32k(), "abc": 3}, "real_seq_len.abc"),
    ({**_hist32k(), "1024": -1}, "real_seq_len.1024"),
    ({**_hist32k(), ">64k": 1}, "real_seq_len.>64k"),
    ({k: v for k, v in _hist32k().items() if k != "32768"}, "real_seq_len.>32k"),
])
def test_bad_histogram_is_one_line_naming_line_and_field(tmp_path, hist, field):
    f = _write(tmp_path, [_launch(0, 32768, hist=_hist32k()), _launch(1, 32768, hist=hist)])
    with pytest.raises(ConfigError) as e:
        load_runs(f)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{f}:2: seq_len_histogram.rank0_or_first.{field}:")


def test_null_mode_on_a_finished_launch_is_still_an_error(tmp_path):
    f = _write(tmp_path, [_launch(0, 4096, mode=None, status="ok")])
    with pytest.raises(ConfigError, match=r":1: effective.mode: unknown None"):
        load_runs(f)
