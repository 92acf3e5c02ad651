"""The one choice the ControlNet paths share with the system config, in a module of its own so that
the config (sim) and the denoise loop (real, torch) both import it without importing each other."""
from __future__ import annotations

import enum


class Aggregation(enum.StrEnum):
    """How N ControlNets' residuals combine: diffusers' ``MultiControlNetModel`` sum, or the Katz
    code's mean with one shared scale (a labelled variant)."""

    sum = "sum"
    katz_mean = "katz_mean"
