"""impl.lobra.diagnose replays a real record's plans: the R_S-cap bound never exceeds the
planned R_L time of LobRA's own plan (R_L must run every sequence beyond R_S's max_tokens)."""
from impl.lobra.diagnose import diagnose

FITS = {"R_L": {"c": [2e-8, 0.0, 9e-5, 0.0, 1e-4, 4e-3], "r2": 0.99},
        "R_S": {"c": [1.5e-8, 0.0, 7e-5, 0.0, 1e-4, 3e-3], "r2": 0.99}}


def _record(rounds=3):
    tasks = [{"name": "short", "batch_seqs": 6, "lengths": {"kind": "lognormal", "median": 60.0, "sigma": 0.5,
                                                            "min_len": 8, "max_len": 128, "clip": True}},
             {"name": "long", "batch_seqs": 5, "lengths": {"kind": "lognormal", "median": 180.0, "sigma": 0.6,
                                                           "min_len": 8, "max_len": 512, "clip": True}}]
    model = {"name": "tiny", "num_layers": 2, "hidden": 64, "heads": 4, "ffn_mult": 4, "ffn_hidden": 128,
             "kv_heads": 0, "vocab": 512, "seq_len": 512}
    system = {"num_buckets": 4, "fixed_buckets": [64, 128, 256, 512], "dispatch": "balanced", "exec_mode": "fused",
              "ilp_time_limit_s": 2.0, "ilp_gap": 0.005, "bucket_cuts": "auto",
              "real": {"large_max_tokens": 512, "small_max_tokens": 128, "interleave": ["lobra", "task_fused"]}}
    steps = {p: [{"round": r, "step_s": 1.0, "compute_s": [[0.9], [0.5]], "pad_ratio": 0.1} for r in range(1, rounds)]
             for p in ("lobra", "task_fused")}
    return {"seed": 2, "config": {"workload": {"tasks": tasks, "model": model, "num_gpus": 2, "steps": rounds - 1,
                                               "warmup_steps": 1}, "system": system},
            "info": {"cost_fit": FITS, "steps": steps, "fit_measured_over_predicted": {}}}


def test_cap_bound_below_lobra_planned_r_l_time():
    rows = diagnose(_record())
    lob = [x for x in rows if x["policy"] == "lobra"]
    assert [x["round"] for x in lob] == [1, 2]
    assert any(x["long_token_frac"] > 0 for x in lob)  # some round has sequences only R_L holds
    for x in lob:
        assert 0 <= x["long_token_frac"] < 1
        assert 0 <= x["cap_bound_s"] <= x["predicted_s"][0] + 1e-12
        assert x["idle_frac"] == [0.09999999999999998, 0.5]
