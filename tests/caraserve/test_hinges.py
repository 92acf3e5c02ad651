"""CaraServe's hinge experiments (conf/experiment/caraserve/hinges.yaml: S3 routing;
hinges_stall.yaml: the cold-start share): every point types and moves only its declared key."""
from tests.support.hinge_points import check_points


def test_every_s3_hinge_point_types_and_moves_only_its_key():
    assert check_points("caraserve/hinges", ["system=caraserve/mostidle"]) == 8


def test_every_stall_share_hinge_point_types_and_moves_only_its_key():
    assert check_points("caraserve/hinges_stall", ["workload.trace.rate_rps=9"]) == 9


def test_a_figure_passing_through_the_band_between_two_swept_values_holds_there():
    # S3 MostIdle on Punica's kernel: 5.7% at kernel speed 0.25, 28.8% at 0.5, 97.7% as composed
    # (1.0); the band 15.3-18.7% lies between the two swept values, neither of which is in it.
    from bench.hinges import _crossing

    x, side, ok = _crossing([0.25, 0.5], [0.057, 0.288], 0.153, 0.187, 1.0, 0.977)
    assert ok and side == "<=" and abs(x - (0.25 + (0.187 - 0.057) / (0.288 - 0.057) * 0.25)) < 1e-9
    assert _crossing([0.25, 0.5], [0.3, 0.5], 0.153, 0.187, 1.0, 0.977) == (None, "", False)
