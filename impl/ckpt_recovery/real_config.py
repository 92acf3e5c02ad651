"""Real-mode knobs of the checkpoint-recovery systems: a placeholder (no knob yet); the real
recovery loop's version replaces it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RealKnobs:
    pass
