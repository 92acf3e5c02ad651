"""Check a hinge experiment's points (bench/hinges.py): each composes and types, and moves exactly
the key its input declares to the declared value; point 0 moves nothing."""
from __future__ import annotations

from typing import Any

import pytest
from omegaconf import OmegaConf

from bench.config import compose_config
from bench.hinges import apply_point, points, typed
from bench.system_choice import choice_of
from bench.validate import typed_job

_MISSING = object()


def _flat(node: Any, prefix: str = "") -> dict:
    """Dotted paths to leaves; a list of mappings (a workload's tasks) opens up, a list of values is
    one value."""
    if isinstance(node, dict) or (isinstance(node, list) and node and all(isinstance(v, dict) for v in node)):
        out = {}
        for k, v in (node.items() if isinstance(node, dict) else enumerate(node)):
            out.update(_flat(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: node}


def flat_config(cfg) -> dict:
    return _flat(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))


def changed_keys(flat: dict, cfg) -> set:
    """Dotted keys where ``cfg`` differs from the flattened ``flat`` (the point index aside)."""
    other = flat_config(cfg)
    return {k for k in flat.keys() | other.keys() if flat.get(k) != other.get(k)} - {"hinges.point"}


def _config(overrides: list[str]) -> tuple[dict, list[str]]:
    cfg = compose_config(overrides)
    added = apply_point(cfg, [])
    typed_job(cfg)
    data = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    data.pop("hinges")
    return _flat(data), added


def check_points(experiment: str, setting: list[str], system_key: str = "system") -> int:
    """Compose ``experiment`` at every point on ``setting`` (overrides picking one of its settings);
    an input restricted to some systems runs on the first of them. Returns the number of points."""
    base_cfg = compose_config([f"experiment={experiment}", *setting])
    decl = typed(base_cfg.hinges)
    flat = points(decl)
    assert flat, f"{experiment}: no hinge inputs"
    base, added = _config([f"experiment={experiment}", *setting, "hinges.point=0"])
    assert added == [], f"point 0 must run as composed, got {added}"
    bases = {None: base}
    for k, (i, j) in enumerate(flat, start=1):
        inp = decl.inputs[i]
        system = inp.systems[0] if inp.systems else None
        pick = [f"{system_key}={choice_of(system) if system_key == 'system' else system}"] if system else []
        mine = [o for o in setting if not (system and o.startswith(f"{system_key}="))]
        if system not in bases:
            bases[system] = _config([f"experiment={experiment}", *mine, *pick, "hinges.point=0"])[0]
        before = bases[system]
        after, added = _config([f"experiment={experiment}", *mine, *pick, f"hinges.point={k}"])
        assert len(added) == 1 and added[0].startswith(inp.key + "="), (k, inp.name, added)
        changed = {p for p in set(before) | set(after) if before.get(p, _MISSING) != after.get(p, _MISSING)}
        # A knob carried from a fitted profile reads null until the point sets it (knobs: null -> {knob: v}).
        assert changed and all(p == inp.key or inp.key.startswith(p + ".") for p in changed), (k, inp.name, changed)
        if inp.values:
            assert after[inp.key] == inp.values[j], (k, inp.name, after[inp.key], inp.values[j])
        else:  # an integer key keeps its type: the product is rounded
            want = before[inp.key] * inp.factors[j]
            assert after[inp.key] == pytest.approx(want, rel=1e-9, abs=0.5 if isinstance(before[inp.key], int) else 0), \
                (k, inp.name, after[inp.key], want)
    return len(flat)
