"""Typed fault specs (defined in :mod:`impl.common.fault_model.spec`, which the runtime reads too)."""
from impl.common.fault_model.spec import (  # noqa: F401  (re-exported: the systems' and harness's import)
    KINDS, ComputeSlowdown, DelayEvent, DpLinkDelay, GpuLoss, LinkDelay, NodeLoss, NoFault, RankKill,
    SlowdownEvent, VaryingLinkDelay)
