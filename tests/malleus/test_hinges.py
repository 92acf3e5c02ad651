"""Malleus's hinge experiment (conf/experiment/malleus/hinges.yaml): every point types and moves
only its declared key, on the S5 70B setting (the headline's largest)."""
from tests.support.hinge_points import check_points


def test_every_hinge_point_types_and_moves_only_its_key():
    assert check_points("malleus/hinges", ["experiment/malleus/hinge_settings@_global_=s5_70b",
                                           "hardware=h100-sxm", "system=malleus/uniform"]) == 10
