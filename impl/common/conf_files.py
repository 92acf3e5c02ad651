"""A config group file read outside Hydra's composition, with its ``defaults:`` applied the way
Hydra applies them (each listed config first, then the file itself, ``_self_`` last): a
``conf/system`` variant states only what differs from its paper's base.

Also the one rule that gives a system node the identity its path implies
(:func:`system_identity`): system yamls do not repeat their own name or policy."""
from __future__ import annotations

import dataclasses
import importlib
import pathlib
from typing import Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from impl.common.errors import ConfigError

# Hydra's package keyword for "merge into the including file's own node"; a variant's defaults
# entry carries it because the base sits in a sub-folder of the group.
_HERE = "@_here_"


def load_group_file(path: pathlib.Path, root: Optional[pathlib.Path] = None, _seen: tuple = ()) -> DictConfig:
    """``root`` is the group's folder (``conf/system``): defaults entries are paths relative to it,
    as Hydra reads them (default: the file's own folder)."""
    path = pathlib.Path(path)
    root = path.parent if root is None else pathlib.Path(root)
    if not path.is_file():
        raise ConfigError(f"{path.parent.name}={path.stem}: no {path}")
    if path in _seen:
        raise ConfigError(f"{path}: defaults loop through {', '.join(p.stem for p in _seen)}")
    node = OmegaConf.load(path)
    defaults = node.pop("defaults", None) if isinstance(node, DictConfig) else None
    if not defaults:
        return node
    merged = OmegaConf.create()
    for entry in defaults:
        if entry == "_self_":
            continue
        if not isinstance(entry, str) or ("@" in entry and not entry.endswith(_HERE)):
            raise ConfigError(f"{path}: defaults entry {entry!r}: only names of the same group are read here")
        base = entry[:-len(_HERE)] if entry.endswith(_HERE) else entry
        merged = OmegaConf.merge(merged, load_group_file(root / f"{base}.yaml", root, _seen + (path,)))
    return OmegaConf.merge(merged, node)


def system_identity(node: DictConfig, stem: str) -> DictConfig:
    """``name`` := the yaml's stem, and ``policy`` := the stem where the system's Config has a
    ``policy`` knob, each only when the node has none (an explicit value, from a yaml or an
    override, wins). Changes ``node`` in place and returns it."""
    if node is None or not stem:
        return node
    with open_dict(node):
        if _unset(node, "name"):
            node["name"] = stem
        if _unset(node, "policy") and _has_policy_knob(node.get("_target_")):
            node["policy"] = stem
    return node


def _unset(node: DictConfig, key: str) -> bool:
    # Not resolved: a preset's name may interpolate the policy this rule is about to set.
    return key not in node.keys() or (not OmegaConf.is_interpolation(node, key) and node[key] is None)


def _has_policy_knob(target: Optional[str]) -> bool:
    if not target:
        return False
    module, _, name = str(target).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except Exception:  # a bad _target_ is reported, with its field, when the system is typed
        return False
    config = getattr(cls, "Config", None)
    return dataclasses.is_dataclass(config) and any(f.name == "policy" for f in dataclasses.fields(config))
