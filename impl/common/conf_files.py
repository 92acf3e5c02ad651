"""A config group file read outside Hydra's composition, with its ``defaults:`` applied the way
Hydra applies them (each listed config first, then the file itself, ``_self_`` last): a
``conf/system`` variant states only what differs from its paper's base."""
from __future__ import annotations

import pathlib

from omegaconf import DictConfig, OmegaConf

from impl.common.errors import ConfigError


def load_group_file(path: pathlib.Path, _seen: tuple = ()) -> DictConfig:
    path = pathlib.Path(path)
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
        if not isinstance(entry, str):
            raise ConfigError(f"{path}: defaults entry {entry!r}: only names of the same group are read here")
        merged = OmegaConf.merge(merged, load_group_file(path.with_name(f"{entry}.yaml"), _seen + (path,)))
    return OmegaConf.merge(merged, node)
