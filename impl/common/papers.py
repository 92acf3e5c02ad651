"""The papers' numbers as each system's package ships them (``impl/<system>/paper.yaml``, format:
:mod:`bench.paper`), read by a system's own reports without importing the harness."""
from __future__ import annotations

from omegaconf import OmegaConf

from impl.common.errors import ConfigError
from impl.common.systems import paper_file


def paper_entries(system: str) -> dict:
    """``impl/<system>/paper.yaml``'s entries by name."""
    path = paper_file(system)
    if not path.is_file():
        raise ConfigError(f"paper: no {path} (impl/<system>/paper.yaml)")
    raw = OmegaConf.to_container(OmegaConf.load(str(path)))
    return {e["name"]: e for e in raw.get("entries", [])}
