"""impl.lobra.figures draws each preset's PNG from records (the newest record per case wins)."""
from impl.lobra import figures


def _rec(exp, system, gpus, gpu_s, B=16, created="2026-01-01", pad=0.1, step=1.0, planner=0.5):
    return {"experiment": exp, "system": system, "workload": "lobra_70b_scaling", "mode": "sim", "status": "ok",
            "created": created, "info": {"num_gpus": gpus}, "config": {"system": {"num_buckets": B}},
            "metrics": {"gpu_seconds": {"value": gpu_s, "unit": "GPU-s"}, "padding_ratio": {"value": pad},
                        "step_time_s": {"value": step}, "planner_time_s": {"value": planner}}}


def test_draw_all_writes_one_png_per_figure(tmp_path):
    recs = [_rec("lobra/gpu_scaling", s, g, v) for g in (16, 32) for s, v in
            (("lobra", 10.0), ("task_fused", 20.0), ("task_sequential", 30.0))]
    recs.append(_rec("lobra/gpu_scaling", "lobra", 16, 99.0, created="2025-01-01"))  # older: replaced
    recs += [_rec("lobra/buckets", "lobra", 16, 1.0, B=b, pad=1 / b, step=1 + 1 / b) for b in (4, 8, 16)]
    paths = figures.draw_all(recs, tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in paths) == [
        "buckets/buckets_padding_step_time.png", "gpu_scaling/gpu_seconds_by_system.png",
        "gpu_scaling/planner_time_by_gpus.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
    assert len(figures._latest([r for r in recs if r["experiment"] == "lobra/gpu_scaling"])) == 6
