"""Knobs only real mode reads (``system.real.*``): placeholder; the real-mode branch (hydreal)
replaces this dataclass with its own."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RealKnobs:
    pass
