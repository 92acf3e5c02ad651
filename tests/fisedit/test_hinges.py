"""FISEdit's hinge experiment (conf/experiment/fisedit/hinges.yaml): every point types and moves
only its declared key; the reader finds the A100 claim at a point that re-labels the hardware."""
from bench.hinges import analyze
from tests.support.hinge_points import check_points


def test_every_hinge_point_types_and_moves_only_its_key():
    assert check_points("fisedit/hinges", []) == 14


def _record(point: int, hardware: str, value: float, mfu: float) -> dict:
    return {"experiment": "fisedit/hinges", "system": "fisedit", "workload": "fisedit_sim_sd21", "hardware": hardware,
            "fault": "none", "mode": "sim", "status": "ok", "run_id": f"r{point}", "created": f"2026-01-01T00:00:0{point}",
            "metrics": {"e2e_speedup_vs_diffusers_dense": {"value": value, "unit": "x", "better": "higher"}},
            "config": {"hardware": {"mfu": mfu},
                       "hinges": {"paper": "fisedit", "claims": ["e2e_a100"], "point": point,
                                  "inputs": [{"name": "mfu", "key": "hardware.mfu", "values": [0.2, 0.6],
                                              "source": "test"}]}}}


def test_a_point_that_relabels_the_hardware_still_meets_the_claims_where():
    # The claim filters on hardware: a100-40g; a point moving hardware.mfu labels its record
    # a100-40g[mfu=0.2], which the reader must read as the point-0 setting.
    recs = [_record(0, "a100-40g", 3.2, 0.4), _record(1, "a100-40g[mfu=0.2]", 3.3, 0.2),
            _record(2, "a100-40g[mfu=0.6]", 3.1, 0.6)]
    (ch,) = analyze(recs)
    assert ch.base == 3.2
    assert ch.swings[0].figures == [3.3, 3.1]
