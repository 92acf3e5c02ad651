"""Where a real job's work runs: one decision per job (device, dtype, threads, backend).

The harness resolves the ``execution`` config group (``conf/execution/{auto,cpu,cuda}.yaml``)
once per job into an :class:`Execution` carried on ``JobContext.execution``; every real-mode
system reads its device and dtype from it instead of probing ``torch.cuda`` itself. A job that
starts ranks asks :meth:`Execution.placement` (``impl.common.runtime.launch`` does it for every
launch): several ranks get a GPU each and NCCL only when there are enough GPUs and the system's
ranks can use them; otherwise they run on the CPU with gloo and the placement says why
(``cpu/gloo: 1 GPU < 4 ranks``). Each placement is noted, and the record's ``info.execution``,
``info.device`` / ``info.backend`` and hardware label are written from the notes: where the work
ran, not which devices the host has.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Optional

from impl.common.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "fp32", "fp16", "bf16")
BACKENDS = ("auto", "gloo", "nccl")


class RankScope(StrEnum):
    """Which of a job's ranks run: all of them (the real job), or rank 0 of its layout alone
    against torch's fake process group, estimated under FakeTensorMode on any host
    (``estimate``) or run for real on one GPU (``rank0``): :mod:`impl.common.runtime.rank0`."""

    ALL = "all"
    ESTIMATE = "estimate"
    RANK0 = "rank0"


def set_torch_threads(n: int) -> int:
    """The one place torch's intra-op thread count is set (each worker process calls it for
    itself, with the count the job's execution decision gave it); returns the count before."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, int(n)))
    return before


@dataclass
class ExecutionConfig:
    """The ``execution`` group: what the user asks for; :func:`resolve` decides."""

    # auto = the first CUDA device when torch sees one, else the CPU; cuda refuses the job in
    # preflight, in one line, on a host without one (the gpu/* presets ask for it).
    device: str = "auto"
    # auto = the workload's own dtype (fp32 where it names none); a dtype here overrides it.
    dtype: str = "auto"
    # torch intra-op threads of the job's main process; 0 = the workload's setting, else torch's.
    threads: int = 0
    # Multi-rank jobs: auto = nccl when every local rank gets its own GPU and the system's ranks
    # can use one, else gloo on the CPU.
    backend: str = "auto"
    # all = every rank of the job; estimate / rank0 = rank 0 of the layout alone (RankScope).
    ranks: str = "all"
    # > 0: the job needs this many visible GPUs (the gpu8/* presets: one 8-GPU node); refused
    # in preflight, before any work, on a host with fewer.
    min_gpus: int = 0

    def __post_init__(self) -> None:
        for name, allowed in (("device", DEVICES), ("dtype", DTYPES), ("backend", BACKENDS),
                              ("ranks", tuple(RankScope))):
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"execution.{name}: unknown value {value!r} (one of: {', '.join(allowed)})")
        if self.threads < 0:
            raise ConfigError(f"execution.threads: must be >= 0, got {self.threads}")
        if self.min_gpus < 0:
            raise ConfigError(f"execution.min_gpus: must be >= 0, got {self.min_gpus}")


@dataclass(frozen=True)
class Placement:
    """Where one group of ranks (or the job's single process) ran."""

    device: str  # cpu | cuda
    backend: str  # none (one process) | gloo | nccl
    ranks: int
    gpus: int  # visible to the job
    reason: str = ""  # why not the GPU when one is visible

    @property
    def label(self) -> str:
        head = self.device if self.backend == "none" else f"{self.device}/{self.backend}"
        if self.reason:
            return f"{head}: {self.reason}"
        if self.backend == "nccl":
            return f"{head}: {self.ranks} ranks on {self.ranks} GPUs"
        return head


@dataclass(frozen=True)
class Execution:
    """The resolved decision for one job."""

    device: str = "cpu"  # cpu | cuda
    dtype: str = "auto"  # as asked; :meth:`torch_dtype` resolves it against a workload's choice
    threads: int = 0
    backend: str = "auto"
    gpus: int = 0
    gpu_name: Optional[str] = None
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    ranks: str = "all"  # RankScope

    @property
    def is_cuda(self) -> bool:
        return self.device == "cuda"

    def torch_device(self):
        import torch

        return torch.device("cuda", 0) if self.is_cuda else torch.device("cpu")

    def dtype_name(self, workload_dtype: Optional[str] = None, *, field_name: str = "workload.dtype") -> str:
        """The job's compute dtype: ``execution.dtype`` unless auto, else the workload's (fp32
        when it names none). fp16 needs CUDA (CPU kernels for it are missing or slow)."""
        name = self.dtype if self.dtype != "auto" else (workload_dtype or "fp32")
        where = "execution.dtype" if self.dtype != "auto" else field_name
        if name not in DTYPES[1:]:
            raise ConfigError(f"{where}: unknown value {name!r} (one of: {', '.join(DTYPES[1:])})")
        if name == "fp16" and not self.is_cuda:
            raise ConfigError(f"{where}: fp16 needs a CUDA device (this job runs on the CPU; use fp32 or bf16)")
        return name

    def torch_dtype(self, workload_dtype: Optional[str] = None, *, field_name: str = "workload.dtype"):
        import torch

        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[
            self.dtype_name(workload_dtype, field_name=field_name)]

    def apply_threads(self, workload_threads: int = 0) -> int:
        """Set torch's intra-op threads once for the job: ``execution.threads``, else the
        workload's; returns what is in force."""
        import torch

        n = self.threads or workload_threads
        if n > 0:
            set_torch_threads(n)
        return torch.get_num_threads()

    def placement(self, ranks: int, *, backend: Optional[str] = None, ranks_use_gpu: bool = True) -> Placement:
        """Where ``ranks`` processes on this host run. ``backend`` is the system's own demand
        (None = this job's ``execution.backend``); ``ranks_use_gpu`` False for systems whose
        rank code is CPU-only (the placement then says so)."""
        if ranks < 1:
            raise ConfigError(f"world size: must be >= 1, got {ranks}")
        want = backend or self.backend
        if want not in BACKENDS:
            raise ConfigError(f"backend: unknown value {want!r} (one of: gloo, nccl)")
        enough = self.is_cuda and self.gpus >= ranks
        if want == "nccl":
            if not enough:
                raise ConfigError(f"execution.backend: nccl needs {ranks} visible GPUs, found "
                                  f"{self.gpus if self.is_cuda else 0}")
            return Placement("cuda", "nccl", ranks, self.gpus)
        if want == "auto" and enough and ranks_use_gpu:
            return Placement("cuda", "nccl", ranks, self.gpus)
        if not self.is_cuda:
            reason = "no GPU" if self.gpus == 0 else "execution.device=cpu"
        elif self.gpus < ranks:
            reason = f"{self.gpus} GPU{'s' if self.gpus != 1 else ''} < {ranks} ranks"
        elif not ranks_use_gpu:
            reason = "this system's ranks run on the CPU"
        else:
            reason = "gloo asked for"
        return Placement("cpu", "gloo", ranks, self.gpus, reason)

    def single(self) -> Placement:
        """The job's own process, with no process group."""
        return Placement(self.device, "none", 1, self.gpus)

    def to_dict(self) -> dict:
        return asdict(self)


def visible_gpus() -> tuple[int, Optional[str]]:
    import torch

    if not torch.cuda.is_available():
        return 0, None
    return torch.cuda.device_count(), torch.cuda.get_device_name(0)


def resolve(cfg: Optional[ExecutionConfig] = None) -> Execution:
    """One job's decision; ``device: cuda`` on a host without CUDA is a one-line error."""
    cfg = cfg or ExecutionConfig()
    gpus, name = visible_gpus()
    if gpus < cfg.min_gpus:
        raise ConfigError(f"execution.min_gpus: this job needs {cfg.min_gpus} GPUs on one node, {gpus} visible "
                          f"(torch.cuda.device_count()); execution=estimate runs its rank 0 on any host")
    if cfg.device == "cuda" and gpus == 0:
        raise ConfigError("execution.device: cuda requested but no CUDA device is visible "
                          "(torch.cuda.is_available() is false)")
    device = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and gpus > 0) else "cpu"
    return Execution(device=device, dtype=cfg.dtype, threads=cfg.threads, backend=cfg.backend, gpus=gpus,
                     gpu_name=name, ranks=cfg.ranks)


# ---- what ran where, for the record -------------------------------------------------------
# Notes taken by the launcher (and by single-process systems that place work themselves) while
# a job runs in this process; the runner takes them when the job ends.
_NOTES: list[Placement] = []


_CURRENT: Optional[Execution] = None


def set_current(execution: Optional[Execution]) -> None:
    """The running job's decision, for code below the system that places ranks (the launcher)."""
    global _CURRENT
    _CURRENT = execution


def current() -> Execution:
    """The running job's decision; outside a job, the default (``auto``) one."""
    return _CURRENT if _CURRENT is not None else resolve()


def note(placement: Placement) -> Placement:
    _NOTES.append(placement)
    return placement


def take_notes() -> list[Placement]:
    out = list(_NOTES)
    _NOTES.clear()
    return out


def summarize(execution: Execution, notes: list[Placement]) -> dict:
    """The record's ``info.execution``: the decision and every placement that ran; the job's
    device/backend are the placements' (the largest group's when they differ), else the job's."""
    main = max(notes, key=lambda p: p.ranks) if notes else execution.single()
    labels = list(dict.fromkeys(p.label for p in notes)) or [main.label]
    if execution.ranks != RankScope.ALL:
        labels.insert(0, f"{execution.ranks}: rank 0 of the layout alone, the other ranks a fake process group")
    return {"device": main.device, "backend": main.backend, "label": "; ".join(labels), "ranks": execution.ranks,
            "decision": execution.to_dict(), "placements": [asdict(p) for p in notes]}


def hardware_label(summary: dict) -> str:
    """``local-cuda[NVIDIA H200]`` when the work ran on the GPU; ``local-cpu[16 cores]``
    otherwise, with the reason when a GPU was there but not used."""
    decision = summary["decision"]
    if summary["device"] == "cuda":
        return f"local-cuda[{decision.get('gpu_name') or 'cuda'}]"
    reasons = sorted({p["reason"] for p in summary["placements"] if p.get("reason")})
    extra = f"; {'; '.join(reasons)}" if decision.get("gpus") and reasons else ""
    return f"local-cpu[{decision.get('cores') or os.cpu_count()} cores{extra}]"
