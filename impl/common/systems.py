"""Which systems the repository holds, and the files each system's package owns.

A system is a package under ``impl/`` other than the shared substrate ``impl/common``: nothing
keeps a list of them, so a new package is picked up by every table, contract and check that asks
here. A package found on any entry of ``impl.__path__`` counts (a checkout, an installed copy,
or a tree a test adds)."""
from __future__ import annotations

import importlib.util
import pathlib
import pkgutil

import impl
from impl.common.errors import ConfigError

SUBSTRATE = "common"
PAPER_FILE = "paper.yaml"


def systems() -> tuple[str, ...]:
    """The system packages under ``impl/``, sorted by name."""
    return tuple(sorted({m.name for m in pkgutil.iter_modules(impl.__path__)
                         if m.ispkg and m.name != SUBSTRATE}))


def package_dir(system: str) -> pathlib.Path:
    """The folder of ``impl/<system>``, found without importing the system (its imports may be heavy)."""
    spec = importlib.util.find_spec(f"impl.{system}") if system.isidentifier() else None
    if spec is None or not spec.submodule_search_locations or system == SUBSTRATE:
        raise ConfigError(f"system: {system!r} is not a system package under impl/ "
                          f"(found: {', '.join(systems())})")
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def paper_file(system: str) -> pathlib.Path:
    """``impl/<system>/paper.yaml``: the paper's numbers this system reproduces (format: bench.paper)."""
    return package_dir(system) / PAPER_FILE
