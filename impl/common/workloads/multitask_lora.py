"""Workload for multi-tenant LoRA fine-tuning (LobRA): several tasks share one frozen base; each
task has its own sequence-length distribution and per-step batch (sequences per step).

``tasks`` is a list of :class:`TaskSpec`: ``name``, ``lengths`` (a
:class:`~impl.common.varlen.lengths.LengthDist`; its ``max_len`` is the task's maximum) and
``batch_seqs`` (the task's per-step global batch, LobRA's appendix Table 4). ``model`` is the frozen
base; ``lora_rank`` / ``lora_alpha`` the adapters of every task (r = 16, alpha = 16 as in
the authors' code, Hetu `examples/lobra`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from impl.common.api import ConfigError
from impl.common.varlen.lengths import LengthDist
from impl.common.workloads.varlen import VarlenModelShape


@dataclass
class TaskSpec:
    name: str = "task"
    lengths: LengthDist = field(default_factory=LengthDist)
    batch_seqs: int = 16  # sequences of this task per step
    avg_tokens: float = 0.0  # label: the dataset's published mean length (0 = not given)
    skewness: float = 0.0  # label: the dataset's published skewness (0 = not given)


@dataclass
class MultitaskLoraWorkload:
    kind: str = "multitask_lora"
    model: VarlenModelShape = field(default_factory=VarlenModelShape)
    num_gpus: int = 2
    gpus_per_node: int = 8
    tasks: List[TaskSpec] = field(default_factory=list)
    steps: int = 4
    warmup_steps: int = 1
    dtype: str = "fp32"
    lora_rank: int = 16
    lora_alpha: float = 16.0
    lr: float = 1e-4
    torch_threads: int = 1

    @property
    def max_len(self) -> int:
        """Longest sequence any task may draw."""
        return max(t.lengths.max_len for t in self.tasks)

    def validate(self) -> None:
        for name in ("num_gpus", "gpus_per_node", "steps", "lora_rank", "torch_threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"workload.{name}: must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ConfigError(f"workload.warmup_steps: must be >= 0, got {self.warmup_steps}")
        if not self.tasks:
            raise ConfigError("workload.tasks: a multi-task LoRA job needs >= 1 task, got none")
        seen = set()
        for i, t in enumerate(self.tasks):
            if t.name in seen:
                raise ConfigError(f"workload.tasks[{i}].name: {t.name!r} repeats")
            seen.add(t.name)
            if t.batch_seqs < 1:
                raise ConfigError(f"workload.tasks[{i}].batch_seqs: task {t.name!r} has no data "
                                  f"({t.batch_seqs} sequences per step; must be >= 1)")
            t.lengths.field = f"workload.tasks[{i}].lengths"
            t.lengths.validate()
            if t.lengths.max_len < 1:
                raise ConfigError(f"workload.tasks[{i}].lengths.max_len: task {t.name!r} needs a maximum length "
                                  f"(> 0), got {t.lengths.max_len}")
