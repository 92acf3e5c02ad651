"""Scenario A side by side, one seed (until the harness system exists):
``python -m impl.ckpt_recovery.measure [nas|local]``. Saves from TP2xPP2 (4 ranks) with every
system, loads ours on [TP2 | TP1] (3 survivors) and DCP's on TP2 (2 ranks), prints JSON."""
from __future__ import annotations

import json
import statistics
import sys
import tempfile

from impl.common.checkpoint.layout import StagePlan
from impl.common.runtime.launch import launch
from impl.common.storage.emulator import profile
from impl.common.workloads.pipeline import ModelShape

from impl.ckpt_recovery.bench import BenchSpec, load_phase, save_phase

TINY = ModelShape(name="tiny", num_layers=4, hidden=256, heads=8, ffn_hidden=1024, vocab=4096, seq_len=64)


def main(prof_name: str = "nas", seed: int = 0) -> dict:
    spec = BenchSpec(TINY, seed=seed, root=tempfile.mkdtemp(prefix="ckpt-measure-"), splits=32,
                     prof=profile(prof_name), saves=3, compute_s=0.5,
                     systems=("elastor", "dcp_sync", "dcp_async"),
                     old=((StagePlan((0, 1), (0, 2)), StagePlan((2, 3), (2, 4))),),
                     new=((StagePlan((0, 1), (0, 3)), StagePlan((2,), (3, 4))),))
    saved = launch(save_phase, 4, (spec,), label="save", timeout_s=900).results
    out: dict = {"storage": prof_name, "emulated": profile(prof_name).emulated, "seed": seed}
    for s in spec.systems:
        st = [x for r in saved for x in r[s]["stall_s"]]
        out[s] = {"stall_s_median": statistics.median(st)}
    out["elastor"]["log"] = saved[0]["elastor_log"]
    for s, world in (("elastor", 3), ("dcp_sync", 2)):
        res = launch(load_phase, world, (spec, s), label=f"load {s}", timeout_s=900).results
        out[s].update({"t_load_s_max": max(r["t_load_s"] for r in res),
                       "read_calls_per_rank": [r["read_calls"] for r in res],
                       "read_amplification": [round(r["read_amplification"], 3) for r in res],
                       "bit_exact": all(r["bit_exact"] for r in res), "ranks": world})
    return out


if __name__ == "__main__":
    print(json.dumps(main(*(sys.argv[1:2] or ["nas"])), indent=1))
