"""CaraServe sweep figures: the numbers they draw come from the records' own configs."""
import pathlib

from impl.caraserve.figures import latency_ratio_map, latency_ratios, slo_vs_rate


def rec(policy, rate, out, overhead, latency, status="ok", name=None, slo=None):
    metrics = {"latency_mean_s": {"value": latency}}
    if slo is not None:
        metrics["slo_attainment"] = {"value": slo}
    return {"status": status, "system": name or policy, "metrics": metrics,
            "config": {"system": {"policy": policy, "cost": {"load_overhead_s": overhead}},
                       "workload": {"trace": {"rate_rps": rate, "output_median": out}}}}


def test_ratios_pair_records_by_swept_values_and_carry_flags():
    records = [rec("slora", 7, 120, 0.0, 3.0), rec("caraserve", 7, 120, 0.0, 2.0),
               rec("slora", 7, 120, 0.02, 5.0), rec("caraserve", 7, 120, 0.02, 2.5, status="invalid"),
               rec("slora", 9, 120, 0.0, 4.0),  # no CaraServe partner: no cell
               rec("caraserve", 9, 60, 0.0, 1.0, status="failed")]
    got = latency_ratios(records)
    assert got == {(7, 120, 0.0): (1.5, False), (7, 120, 0.02): (2.0, True)}


def test_figures_write_pngs(tmp_path):
    records = [rec("slora", r, o, h, 2.0 + h, slo=0.9) for r in (7, 9) for o in (60, 120) for h in (0.0, 0.01)]
    records += [rec("caraserve", r, o, h, 1.5, slo=0.99) for r in (7, 9) for o in (60, 120) for h in (0.0, 0.01)]
    for paths in (latency_ratio_map(records, tmp_path), slo_vs_rate(records, tmp_path)):
        assert len(paths) == 1 and pathlib.Path(paths[0]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert latency_ratio_map([], tmp_path) == [] and slo_vs_rate([], tmp_path) == []
