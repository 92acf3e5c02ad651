import pytest

from impl.common.errors import ConfigError
from impl.common.registry import Registry


def test_get_returns_registered_component_and_names_keep_order():
    reg: Registry = Registry("policy")

    @reg.register("b", "b_alias")
    def b():
        return 2

    reg.add("a", 1)
    assert reg.get("b")() == 2 and reg.get("b_alias") is b and reg.get("a") == 1
    assert reg.names() == ("b", "b_alias", "a") and "a" in reg and len(reg) == 3


def test_unknown_name_is_one_line_naming_the_field_and_choices():
    reg: Registry = Registry("baseline", field="system.baseline")
    reg.add("x", 0)
    with pytest.raises(ConfigError) as err:
        reg.get("y")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("system.baseline:") and "'y'" in msg and "x" in msg


def test_a_name_registers_once():
    reg: Registry = Registry("policy")
    reg.add("x", 0)
    with pytest.raises(ValueError):
        reg.add("x", 1)
