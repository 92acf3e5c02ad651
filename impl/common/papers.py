"""The papers' numbers as the harness ships them (``bench/data/paper/<system>.yaml``, format:
:mod:`bench.paper`), read by a system's own reports. Read from the file beside the installed
packages, so no system imports the harness."""
from __future__ import annotations

import pathlib

PAPER_DIR = pathlib.Path(__file__).resolve().parents[2] / "bench" / "data" / "paper"


def paper_entries(system: str) -> dict:
    """``bench/data/paper/<system>.yaml``'s entries by name."""
    from omegaconf import OmegaConf

    from impl.common.api import ConfigError

    path = PAPER_DIR / f"{system}.yaml"
    if not path.is_file():
        raise ConfigError(f"paper: no {path} (bench/data/paper/<system>.yaml)")
    raw = OmegaConf.to_container(OmegaConf.load(str(path)))
    return {e["name"]: e for e in raw.get("entries", [])}
