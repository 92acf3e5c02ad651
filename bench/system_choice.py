"""System configs live in paper folders: ``conf/system/<paper>/<stem>.yaml``, chosen as
``system=<paper>/<stem>``. The stem stays the system's name (records, gates, paper rows key on
it), so the yaml does not repeat it: :func:`apply_choice` gives the composed node its name and
policy from the choice, at every place a job config is composed.

Names map to choices by scanning the folders (:func:`choice_of`), for code that builds ``system=``
overrides from record names; an old flat choice (``system=hydraulis_b0``) fails in one line that
names its new place (:func:`flat_choice_error`)."""
from __future__ import annotations

import functools
import re
from importlib import resources
from typing import Iterable, Optional

from omegaconf import DictConfig

from impl.common.conf_files import system_identity
from impl.common.errors import ConfigError

GROUP = "system"


@functools.lru_cache(maxsize=1)
def _index() -> tuple[tuple[str, str], ...]:
    """(stem, paper) of every system yaml of the package's conf, by paper then stem."""
    root = resources.files("conf").joinpath(GROUP)
    out = []
    for folder in sorted(root.iterdir(), key=lambda e: e.name):
        if folder.is_dir():
            out += [(stem, folder.name) for stem in sorted(e.name[:-5] for e in folder.iterdir()
                                                           if e.name.endswith(".yaml"))]
    return tuple(out)


def by_paper() -> dict[str, list[str]]:
    """Paper folder -> its system names, sorted."""
    out: dict[str, list[str]] = {}
    for stem, paper in _index():
        out.setdefault(paper, []).append(stem)
    return out


def names() -> list[str]:
    return sorted(stem for stem, _ in _index())


def choice_of(name: str) -> str:
    """``hydraulis_b0`` -> ``hydraulis/hydraulis_b0``. A choice that already names its folder, or a
    name no paper folder holds (a system of a test's or the working directory's own conf/), is
    returned as it is: Hydra then finds it, or says it has no such system."""
    name = str(name)
    if "/" in name:
        return name
    found = [f"{paper}/{stem}" for stem, paper in _index() if stem == name]
    if len(found) > 1:
        raise ConfigError(f"system={name}: in several paper folders ({', '.join(found)})")
    return found[0] if found else name


def stem_of(choice: str) -> str:
    return str(choice).rstrip("/").rsplit("/", 1)[-1]


def apply_choice(cfg: DictConfig, choice: Optional[str]) -> DictConfig:
    """The job's system node gets the name (and policy) its chosen yaml's stem implies."""
    if cfg.get(GROUP) is not None and choice:
        system_identity(cfg[GROUP], stem_of(choice))
    return cfg


def apply_hydra_choice(cfg: DictConfig) -> DictConfig:
    """:func:`apply_choice` for a config composed with its ``hydra`` node (the choice is there)."""
    return apply_choice(cfg, cfg.hydra.runtime.choices.get(GROUP))


# ``system=a``, ``+system=a``, ``system=a,b``, ``system=choice(a,b)``; not ``system.policy=...``.
_SYSTEM_OVERRIDE = re.compile(r"^[+~]{0,2}system=(.*)$")


def flat_choice_error(overrides: Iterable[str]) -> Optional[str]:
    """The one-line error for the first override that picks a system by its old flat name."""
    known = {stem: paper for stem, paper in _index()}
    for override in overrides:
        m = _SYSTEM_OVERRIDE.match(str(override))
        if not m:
            continue
        value = m.group(1).strip()
        inner = re.fullmatch(r"choice\((.*)\)", value)
        for part in (inner.group(1) if inner else value).split(","):
            part = part.strip().strip("'\"")
            if part in known:
                return (f"system={part}: system configs live in paper folders now; "
                        f"use system={known[part]}/{part}")
    return None


# The yamls no longer hold ``name``/``policy``, so a plain ``system.name=x`` would be an unknown key
# to Hydra; ``++`` sets it whether or not the yaml has it, which is what the user means.
_IDENTITY_OVERRIDE = re.compile(r"^system\.(name|policy)=")


def identity_overrides(overrides: Iterable[str]) -> list[str]:
    """``system.name=x`` / ``system.policy=x`` as ``++system.name=x``: an explicit value wins."""
    return [f"++{o}" if _IDENTITY_OVERRIDE.match(str(o)) else str(o) for o in overrides]
