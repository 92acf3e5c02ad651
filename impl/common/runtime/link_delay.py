"""Per-iteration link delays for the real runtime: injection (oracle) and detection (measured).

**Injection.** :class:`LinkDelayController` turns a :class:`impl.common.fault_model.spec.LinkDelay` (or a fixed
``{(i, i+1): seconds}`` table) into the table in force at each iteration, using
:func:`impl.common.fault_model.link_delay.link_delays_at` (the function the simulator uses too). Rank 0
publishes the table in the job's TCPStore under one key per iteration and every rank reads
that key at the start of the iteration, so all ranks sleep the same delays
and build the same schedule, as the artifact does with Redis.

**Detection.** ``detection='oracle'`` hands the injected table to the scheduler.
``detection='measured'`` hands it :class:`DelayEstimator`'s estimate instead: every message
carries its send time relative to the sender's iteration origin (ranks align origins at
iteration start with an all-reduce); the receiver's transit time per message
goes into a :class:`TransitMonitor`; at iteration end the per-link minimum transit (the
minimum filters out queueing behind other messages) is all-reduced and fed to a change
detector, which moves a link's estimate only after the new level persisted ``patience``
iterations. The estimate therefore lags the injection by ``patience`` iterations.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

from impl.common.fault_model.link_delay import link_delays_at, validate_link_delay
from impl.common.fault_model.spec import LinkDelay
from impl.common.api import ConfigError

Link = tuple[int, int]
DETECTIONS = ("oracle", "measured")


def all_links(num_stages: int) -> list[Link]:
    return [(i, i + 1) for i in range(num_stages - 1)]


def link_of(a: int, b: int) -> Link:
    """The link a message between neighbouring ranks ``a`` and ``b`` travels on."""
    if abs(a - b) != 1:
        raise ValueError(f"ranks {a} and {b} are not pipeline neighbours")
    return (min(a, b), max(a, b))


class LinkDelayController:
    """The injected per-link delay table at each iteration, shared through the TCPStore."""

    KEY = "adaptra/link_delays/iter{}"

    def __init__(self, fault: Union[None, LinkDelay, Mapping[Link, float]], num_stages: int,
                 detection: Optional[str] = None) -> None:
        self.num_stages = num_stages
        if fault is None or isinstance(fault, Mapping):
            table = {}
            for link, delay in dict(fault or {}).items():
                a, b = (int(x) for x in link)
                # Reuse the fault validator so the message is the same one a yaml fault gets.
                validate_link_delay(LinkDelay(links=[[a, b]], delay_s=float(delay)), num_stages)
                table[(a, b)] = float(delay)
            self._fixed: Optional[dict[Link, float]] = {k: v for k, v in table.items() if v > 0}
            self.fault = None
            default_detection = "oracle"
        else:
            validate_link_delay(fault, num_stages)
            self._fixed = None
            self.fault = fault
            default_detection = fault.detection
        self.detection = detection or default_detection
        if self.detection not in DETECTIONS:
            raise ConfigError(f"fault.detection: unknown value {self.detection!r} (one of: oracle, measured)")

    def delays_at(self, iteration: int) -> dict[Link, float]:
        """``{link: seconds}`` for every link of the pipeline (0.0 where healthy)."""
        table = dict.fromkeys(all_links(self.num_stages), 0.0)
        active = self._fixed if self._fixed is not None else link_delays_at(self.fault, iteration, self.num_stages)
        table.update(active)
        return table

    def max_delay_s(self, iterations: int) -> float:
        return max((max(self.delays_at(it).values(), default=0.0) for it in range(iterations)), default=0.0)

    # -- TCPStore exchange (rank 0 publishes, every rank reads) ---------------------------
    def publish(self, store, iteration: int) -> None:
        table = self.delays_at(iteration)
        store.set(self.KEY.format(iteration), json.dumps([[a, b, d] for (a, b), d in sorted(table.items())]))

    def read(self, store, iteration: int) -> dict[Link, float]:
        # store.get blocks until rank 0 has published this iteration's key (store timeout).
        raw = store.get(self.KEY.format(iteration))
        return {(int(a), int(b)): float(d) for a, b, d in json.loads(raw)}


class TransitMonitor:
    """Transit times of the messages one rank received during one iteration."""

    def __init__(self) -> None:
        self.samples: dict[Link, list[float]] = {}

    def record(self, link: Link, transit_s: float) -> None:
        self.samples.setdefault(link, []).append(transit_s)

    def min_transit(self) -> dict[Link, float]:
        return {link: min(v) for link, v in self.samples.items() if v}

    def reset(self) -> None:
        self.samples.clear()


@dataclass
class DelayEstimator:
    """Change detector over per-iteration minimum transit times, one level per link.

    An observation is ``max(0, min_transit - floor_s)``. A link's estimate moves to the mean of
    the deviating observations once ``patience`` consecutive ones differ from it by more than
    ``max(abs_threshold_s, rel_threshold * estimate)``; estimates are rounded to ``quantum_s``
    so that small jitter does not rebuild the schedule every iteration.
    """

    num_stages: int
    floor_s: float = 0.0005  # transit of an undelayed message on a loaded host: ~0.1-1 ms
    abs_threshold_s: float = 0.004
    rel_threshold: float = 0.10  # Falcon's "means differ >= 10%"
    patience: int = 2
    quantum_s: float = 0.001
    estimates: dict[Link, float] = field(default_factory=dict)
    _run: dict[Link, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.estimates:
            self.estimates = dict.fromkeys(all_links(self.num_stages), 0.0)

    def update(self, min_transit: Mapping[Link, float]) -> dict[Link, float]:
        for link in all_links(self.num_stages):
            t = min_transit.get(link)
            if t is None or not math.isfinite(t):
                continue  # no message on this link this iteration: nothing learned
            obs = max(0.0, t - self.floor_s)
            cur = self.estimates[link]
            if abs(obs - cur) > max(self.abs_threshold_s, self.rel_threshold * cur):
                run = self._run.setdefault(link, [])
                run.append(obs)
                if len(run) >= self.patience:
                    level = sum(run) / len(run)
                    self.estimates[link] = round(level / self.quantum_s) * self.quantum_s
                    run.clear()
            else:
                self._run.pop(link, None)
        return dict(self.estimates)
