"""Compute-slowdown injection (defined in :mod:`impl.common.fault_model.compute_slowdown`, which the real
runtime reads too)."""
from impl.common.fault_model.compute_slowdown import (  # noqa: F401  (re-exported: the systems' import)
    change_iterations, slowdown_at, validate_compute_slowdown)
