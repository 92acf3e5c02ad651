"""impl.common.systems: the systems are the packages under impl/, found, never listed."""
from __future__ import annotations

import pathlib

import pytest

from impl.common.errors import ConfigError
from impl.common.systems import package_dir, paper_file, systems

IMPL = pathlib.Path(__file__).resolve().parents[2] / "impl"


def test_systems_are_the_packages_under_impl_but_common():
    on_disk = sorted(d.name for d in IMPL.iterdir() if (d / "__init__.py").is_file() and d.name != "common")
    assert list(systems()) == on_disk and "hydraulis" in on_disk


def test_a_system_s_files_are_in_its_package():
    assert package_dir("lobra") == IMPL / "lobra"
    assert paper_file("lobra") == IMPL / "lobra" / "paper.yaml"


@pytest.mark.parametrize("name", ["common", "nosuch", "../bench", ""])
def test_not_a_system_is_one_line_naming_the_systems(name):
    with pytest.raises(ConfigError, match=r"^system: .* is not a system package under impl/ \(found: adaptra, ") as info:
        package_dir(name)
    assert "\n" not in str(info.value)
