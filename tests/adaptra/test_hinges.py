"""ADAPTRA's hinge experiment (conf/experiment/adaptra/hinges.yaml): every point types and moves
only its declared key."""
from tests.support.hinge_points import check_points


def test_every_hinge_point_types_and_moves_only_its_key():
    assert check_points("adaptra/hinges", ["system=adaptra/adaptra"]) == 19
