"""Elastor and its checkpoint-recovery baselines as registered policies: what real mode runs of
each (its checkpoint backend and the layout after a loss) and whether it is Elastor's own save
path (the only one with local and peer copies and a tier choice). The sim's cost model of each
is :data:`impl.ckpt_recovery.sim.scenario.POLICY_MODELS`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from impl.common.registry import Registry


@dataclass(frozen=True)
class CkptPolicy:
    # real mode's (checkpoint backend, layout after a loss); None: sim only
    real: Optional[tuple[str, str]] = None
    # Elastor's own asynchronous split save (local_copies, peer_copies and tier_choice apply)
    elastor: bool = False


POLICIES: Registry[CkptPolicy] = Registry("value")
POLICIES.add("ckpt_recovery", CkptPolicy(real=("elastor", "replan"), elastor=True))
POLICIES.add("dcp_sync", CkptPolicy(real=("dcp_sync", "homogeneous")))
POLICIES.add("dcp_async", CkptPolicy(real=("dcp_async", "homogeneous")))
POLICIES.add("dcp_async_process", CkptPolicy(real=("dcp_async_process", "homogeneous")))
POLICIES.add("restart_all", CkptPolicy(real=("elastor", "homogeneous")))
POLICIES.add("ucp_like", CkptPolicy())
POLICIES.add("gemini_like", CkptPolicy())

# The policies real mode runs: policy -> (checkpoint backend, layout after a loss).
REAL_POLICIES = {name: p.real for name, p in POLICIES.items() if p.real is not None}
