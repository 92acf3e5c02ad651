"""Knobs only sim mode reads (``system.sim.*``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SimKnobs:
    # ZeRO-1 optimizer sharding in every strategy (spec 2.2: on in every config).
    zero1: bool = True
