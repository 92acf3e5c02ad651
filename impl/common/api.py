"""The contract between the harness (`bench/`) and every system in `impl/`.

A system is a class with a typed ``Config`` dataclass (its knobs, validated before any work)
and a ``run(job)`` method that returns a :class:`RunResult`. The harness never imports a
system by hand: the system yaml names the class in ``_target_``.
"""
from __future__ import annotations

import abc
import dataclasses
import math
import pathlib
import statistics
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Literal, Optional, Sequence

from impl.common.errors import ConfigError, NotApplicable  # noqa: F401  (re-exported: the systems' import)
from impl.common.execution import Execution

Better = Literal["lower", "higher"]
Mode = Literal["sim", "real"]


def _quantile(sorted_vals: Sequence[float], q: float) -> float:
    if len(sorted_vals) == 1:
        return float(sorted_vals[0])
    pos = (len(sorted_vals) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return float(sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo))


@dataclass(frozen=True)
class Metric:
    """One named measurement. ``value`` is the headline (median for repeated samples)."""

    value: float
    unit: str
    better: Better = "lower"
    n: int = 1
    p50: Optional[float] = None
    p10: Optional[float] = None
    p90: Optional[float] = None

    @classmethod
    def scalar(cls, value: float, unit: str, better: Better = "lower") -> "Metric":
        v = float(value)
        return cls(value=v, unit=unit, better=better, n=1, p50=v, p10=v, p90=v)

    @classmethod
    def from_samples(cls, samples: Iterable[float], unit: str, better: Better = "lower") -> "Metric":
        vals = sorted(float(s) for s in samples)
        if not vals:
            raise ValueError("Metric.from_samples needs at least one sample")
        med = statistics.median(vals)
        return cls(value=med, unit=unit, better=better, n=len(vals), p50=med,
                   p10=_quantile(vals, 0.10), p90=_quantile(vals, 0.90))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class RunResult:
    """What a system hands back to the harness for one job."""

    metrics: dict[str, Metric]
    status: Literal["ok", "invalid"] = "ok"
    invalid_reasons: list[str] = field(default_factory=list)
    # Pieces of a real run that were emulated rather than executed (e.g. an H2D copy timed
    # from a bandwidth profile on a CPU-only host). Goes to provenance.emulated.
    emulated: list[str] = field(default_factory=list)
    # Files written under job.out_dir (PNG plots, Chrome traces); logged to W&B.
    artifacts: list[str] = field(default_factory=list)
    # Small JSON-able facts worth keeping (chosen plan, detector mode, algorithm variant).
    info: dict[str, Any] = field(default_factory=dict)

    def mark_invalid(self, reason: str) -> None:
        self.status = "invalid"
        self.invalid_reasons.append(reason)


@dataclass
class JobContext:
    """Everything a system may read about the job besides its own knobs."""

    mode: Mode
    seed: int
    experiment: str
    workload: Any  # typed dataclass from impl.common.workloads (validated)
    workload_name: str
    hardware: Any  # impl.common.hardware.HardwareProfile
    hardware_name: str
    fault: Any  # typed dataclass from impl.common.fault_model.spec (validated)
    fault_name: str
    out_dir: pathlib.Path
    show_progress: bool = True
    # Where real work runs (device, dtype, threads, backend), decided once per job by the
    # harness from the ``execution`` group; real-mode systems read it instead of probing torch.
    execution: Execution = field(default_factory=Execution)


class System(abc.ABC):
    """Base class for every system and baseline.

    Subclasses set ``Config`` to a dataclass of their knobs and ``modes`` to the modes they
    support, and implement :meth:`run`.
    """

    @dataclass
    class Config:
        pass

    modes: ClassVar[tuple[str, ...]] = ("sim", "real")

    def __init__(self, cfg: Any, name: str):
        self.cfg = cfg
        self.name = name

    def require_workload(self, workload: Any, kind: str) -> None:
        """One line when the workload is not of the ``kind`` this system runs."""
        if getattr(workload, "kind", None) != kind:
            raise ConfigError(f"workload.kind: system {self.name!r} needs a {kind!r} workload, "
                              f"got {getattr(workload, 'kind', None)!r}")

    def require_no_fault(self, fault: Any) -> None:
        if fault.kind != "none":
            raise ConfigError(f"fault.kind: system {self.name!r} runs without faults, got {fault.kind!r}")

    # True for systems that can build rank 0 of their layout alone (execution=estimate / rank0,
    # impl.common.runtime.rank0): they implement check_rank0 and branch on job.execution.ranks.
    rank0_builder: ClassVar[bool] = False

    def check_rank0(self, workload: Any, hardware: Any, fault: Any) -> None:
        """The preflight of a rank-0 job (instead of :meth:`check`'s real-mode one)."""
        raise ConfigError(f"execution.ranks: system {self.name!r} has no rank-0 builder "
                          f"(execution=estimate / rank0 run hotspa and lobra)")

    def check(self, mode: str, workload: Any, hardware: Any, fault: Any) -> None:
        """Checks that need the whole job (a fault on a link the workload lacks, a knob that
        only one mode has). Raise ConfigError; called before any job of a sweep starts."""

    @abc.abstractmethod
    def run(self, job: JobContext) -> RunResult:
        """Run one job and return its metrics."""
