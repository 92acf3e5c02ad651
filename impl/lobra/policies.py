"""LobRA and its two baselines as registered policies: what each overrides of the deployment,
dispatch and bucketing knobs, and whether the tasks run jointly or one after another.

LobRA itself takes every knob from the config (the ablation ladder changes them); the baselines
pin what the paper gives them (Task-Fused: one homogeneous deployment sized for the longest
sequence, fixed buckets, even dispatch; Task-Sequential: each task on its own best homogeneous
deployment, fixed buckets, even dispatch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from impl.common.registry import Registry


@dataclass(frozen=True)
class LobRAPolicy:
    # each task its own deployment and step, one after another (else one joint step of all tasks)
    per_task: bool = False
    # None: the config's own knob
    deployment: Optional[str] = None
    dispatch: Optional[str] = None
    bucketing: Optional[str] = None

    def dispatcher(self, cfg) -> str:
        return self.dispatch if self.dispatch is not None else cfg.dispatch

    def bucketing_kind(self, cfg) -> str:
        return self.bucketing if self.bucketing is not None else cfg.bucketing


POLICIES: Registry[LobRAPolicy] = Registry("policy")
POLICIES.add("lobra", LobRAPolicy())
POLICIES.add("task_fused", LobRAPolicy(deployment="homogeneous", dispatch="even", bucketing="fixed"))
POLICIES.add("task_sequential", LobRAPolicy(per_task=True, dispatch="even", bucketing="fixed"))
