"""The authors' preset groupings (c1, c2) and per-group strategies (Hetu `examples/hotspa` [C]), loaded
from ``impl/hotspa/data/presets.yaml`` and validated with one-line errors."""
from __future__ import annotations

import pathlib
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Optional

from omegaconf import OmegaConf

from impl.common.api import ConfigError
from impl.common.varlen.packing import check_boundaries

from impl.hotspa.strategy import GroupPlan, Strategy, parse_strategy


# The named groupings of impl/hotspa/data/presets.yaml: c1, c2 and the A100 preset.
PRESET_GROUPINGS = ("c1", "c2", "a100")


def default_path() -> pathlib.Path:
    return pathlib.Path(str(resources.files("impl.hotspa").joinpath("data", "presets.yaml")))


@dataclass(frozen=True)
class Presets:
    groupings: dict[str, tuple[int, ...]]
    # (model name, num_gpus) -> {(lo, hi): Strategy}
    strategies: dict[tuple[str, int], dict[tuple[int, int], Strategy]]

    def boundaries(self, grouping: str, context: int) -> list[int]:
        """The preset's boundaries at ``context``: those >= context dropped, context on top."""
        if grouping not in self.groupings:
            raise ConfigError(f"system.grouping: no preset {grouping!r} (have: {', '.join(self.groupings)})")
        full = self.groupings[grouping]
        if context > full[0]:
            raise ConfigError(f"workload.context: {context} is above preset {grouping}'s top boundary {full[0]}")
        return [context] + [b for b in full[1:] if b < context]

    def group_plan(self, grouping: str, model: str, num_gpus: int, context: int) -> GroupPlan:
        key = (model, num_gpus)
        if key not in self.strategies:
            have = ", ".join(f"{m}@{n}" for m, n in sorted(self.strategies))
            raise ConfigError(f"workload.model.name / num_gpus: no HotSPa preset for {model}@{num_gpus} GPUs "
                              f"(have: {have}); use system.grouping=planned or explicit")
        b = self.boundaries(grouping, context)
        table = self.strategies[key]
        out = []
        for hi, lo in zip(b, b[1:]):
            if (lo, hi) not in table:
                raise ConfigError(f"impl/hotspa/data/presets.yaml: {model}@{num_gpus} has no strategy for group "
                                  f"{lo}-{hi} (grouping {grouping} at context {context})")
            out.append(table[(lo, hi)])
        return GroupPlan(tuple(b), tuple(out))


def _parse_range(text: str, where: str) -> tuple[int, int]:
    parts = str(text).split("-")
    try:
        lo, hi = (int(p) for p in parts)
    except ValueError:
        raise ConfigError(f"{where}: range {text!r} must be 'lo-hi' in tokens, e.g. '4096-16384'") from None
    if not 0 <= lo < hi:
        raise ConfigError(f"{where}: range {text!r} needs 0 <= lo < hi")
    return lo, hi


def load_presets(path: Optional[str | pathlib.Path] = None) -> Presets:
    p = pathlib.Path(path) if path else default_path()
    return _load(str(p), p.stat().st_mtime_ns if p.exists() else 0)


@lru_cache(maxsize=4)
def _load(path: str, _mtime: int) -> Presets:
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path))
    except (OSError, Exception) as exc:  # noqa: BLE001 - any read/parse failure is one line
        raise ConfigError(f"{path}: cannot load HotSPa presets ({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
    if not isinstance(raw, dict) or set(raw) != {"groupings", "strategies"}:
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise ConfigError(f"{path}: expected exactly the keys groupings and strategies, got {got}")
    groupings = {}
    for name, b in (raw["groupings"] or {}).items():
        groupings[str(name)] = tuple(check_boundaries(b, field=f"{path}: groupings.{name}"))
    strategies: dict[tuple[str, int], dict[tuple[int, int], Strategy]] = {}
    for i, entry in enumerate(raw["strategies"] or []):
        where = f"{path}: strategies[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"model", "num_gpus", "ranges"}:
            raise ConfigError(f"{where}: needs exactly model, num_gpus, ranges")
        n = int(entry["num_gpus"])
        key = (str(entry["model"]), n)
        if key in strategies:
            raise ConfigError(f"{where}: duplicate entry for {key[0]}@{n}")
        table = {}
        for r, s in entry["ranges"].items():
            table[_parse_range(r, f"{where}.ranges")] = parse_strategy(s, n, f"{where}.ranges.{r}")
        strategies[key] = table
    return Presets(groupings, strategies)
