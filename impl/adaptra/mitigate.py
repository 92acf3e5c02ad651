"""What a system does about a slow data-parallel link (scenario S5, impl/adaptra/README.md), and what
it costs.

* :func:`bucketed_allreduce_s`: the gradient ring all-reduce of one stage, in buckets [R]. DDP
  all-reduces gradients bucket by bucket; every bucket's ring runs 2(dp-1) steps and each step
  crosses every ring link, so a per-message delay on one link is paid 2(dp-1) times per
  bucket (``impl.common.cost.comm.dp_allreduce_time_s`` per bucket).
* Controllers (:class:`DpMitigation`): state that changes only at iteration boundaries
  (``boundary``) after seeing iteration times (``observe``). Base: ignore (ZB, 1F1B).
  :class:`RemapOnDetect`: ADAPTRA and ADAPTRA-CPU remap the slow DP link into a pipeline link
  once it is detected (as the paper does), then treat it as one. Falcon's ladder: impl.adaptra.falcon.
"""
from __future__ import annotations

from impl.adaptra.detect import ChangeDetector
from impl.common.cost.comm import dp_allreduce_time_s
from impl.common.registry import Registry


def bucketed_allreduce_s(grad_bytes: float, dp: int, hw, ranks_per_node: int,
                         bucket_bytes: float, slow_link_delay_s: float = 0.0) -> float:
    """All-reduce ``grad_bytes`` over ``dp`` ranks (``ranks_per_node`` per node of profile ``hw``)
    in buckets of ``bucket_bytes`` (last one partial), each bucket paying the slow link's delay
    once per ring step."""
    if dp <= 1 or grad_bytes <= 0:
        return 0.0
    full, rest = divmod(float(grad_bytes), float(bucket_bytes))
    t = int(full) * dp_allreduce_time_s(bucket_bytes, dp, hw, ranks_per_node, slow_link_delay_s)
    if rest > 0:
        t += dp_allreduce_time_s(rest, dp, hw, ranks_per_node, slow_link_delay_s)
    return t


def remap_link(stage: int, stages: int) -> tuple[int, int]:
    """The pipeline link a remapped slow DP link of ``stage`` becomes [R].

    Swapping the roles of the two GPUs behind the slow link with their neighbours makes them
    stages ``stage`` and ``stage + 1`` of one replica (the last stage pairs with the one before
    it); the new DP groups avoid the link.
    """
    return (stage, stage + 1) if stage < stages - 1 else (stages - 2, stages - 1)


class DpMitigation:
    """Base: ignore slow DP links. ``boundary`` applies decided actions before an iteration
    (schedules and mappings change only there); ``observe`` sees each iteration's time."""

    name = "ignore"

    def __init__(self):
        self.remapped = False  # the slow DP link now carries pipeline traffic
        self.healed = False  # a restart excluded the slow link
        self.in_force = "none"
        self._pending: list[tuple[str, float, str]] = []

    def boundary(self, iteration: int, dp_delays: dict) -> list[dict]:
        events = []
        for action, cost_s, why in self._pending:
            if action == "remap":
                self.remapped = True
            elif action == "restart":
                self.healed = True
            self.in_force = action
            events.append({"iteration": iteration, "action": action, "cost_s": cost_s, "why": why})
        self._pending = []
        return events

    def observe(self, iteration: int, time_s: float, dp_delays: dict) -> None:
        pass

    def info(self) -> dict:
        return {"policy": self.name}


class RemapOnDetect(DpMitigation):
    """ADAPTRA (as in the paper): a slow DP link is remapped into a pipeline link as soon as it is
    detected (oracle: the iteration it appears; measured: Falcon's detector)."""

    name = "remap"

    def __init__(self, detection: str, remap_cost_s: float):
        super().__init__()
        self.detection, self.remap_cost_s = detection, remap_cost_s
        self.detector = ChangeDetector() if detection == "measured" else None

    def boundary(self, iteration: int, dp_delays: dict) -> list[dict]:
        if self.detector is None and dp_delays and not self.remapped and not self._pending:
            self._pending.append(("remap", self.remap_cost_s, "oracle: slow DP link"))
        return super().boundary(iteration, dp_delays)

    def observe(self, iteration: int, time_s: float, dp_delays: dict) -> None:
        if self.detector is None:
            return
        change = self.detector.update(time_s)
        if change and change.rel_change > 0 and dp_delays and not self.remapped:
            self._pending.append(("remap", self.remap_cost_s,
                                  f"change at iteration {change.at}, +{change.rel_change:.0%}"))

    def info(self) -> dict:
        out = {"policy": self.name, "detection": self.detection}
        if self.detector:
            out["changes"] = [c.__dict__ for c in self.detector.changes]
        return out


# What a system does about a slow data-parallel link (``system.dp_link_policy``): its mitigation
# for one job, from the system's config and the job.
DP_LINK_POLICIES: Registry = Registry("value", "system.dp_link_policy")
DP_LINK_POLICIES.add("ignore", lambda cfg, job: DpMitigation())
DP_LINK_POLICIES.add("remap", lambda cfg, job: RemapOnDetect(getattr(job.fault, "detection", "oracle"), cfg.remap_cost_s))
