"""Workload for variable-length LLM training (HotSPa, Hydraulis, LobRA reuse it).

A step draws sequence lengths from ``lengths`` (``impl.common.varlen.lengths.LengthDist``):
``global_batch_seqs`` sequences per step (HotSPa: GBS 512) or, when ``token_budget`` > 0, a fixed
token budget G (Hydraulis, LobRA). ``context`` is the longest sequence the job must train: a
length above it is an error unless the distribution clips to it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from impl.common.api import ConfigError
from impl.common.varlen.lengths import LengthDist
from impl.common.workloads.pipeline import ModelShape


@dataclass
class VarlenModelShape(ModelShape):
    """LLaMA-like by default (SwiGLU ``ffn_hidden``); ``seq_len`` is unused (lengths vary)."""

    name: str = "llama-tiny"
    num_layers: int = 4
    hidden: int = 128
    heads: int = 4
    ffn_hidden: int = 352
    vocab: int = 2048
    seq_len: int = 2048


@dataclass
class VarlenWorkload:
    kind: str = "varlen"
    model: VarlenModelShape = field(default_factory=VarlenModelShape)
    num_gpus: int = 2
    gpus_per_node: int = 8
    context: int = 2048  # longest sequence the job trains (tokens)
    lengths: LengthDist = field(default_factory=LengthDist)
    dataset: str = "synthetic"  # label: commoncrawl | github | synthetic (the length stand-in's name)
    global_batch_seqs: int = 64  # sequences per step (0 when token_budget is used)
    token_budget: int = 0  # G tokens per step (> 0: sample by budget instead of by count)
    steps: int = 4
    warmup_steps: int = 1
    dtype: str = "fp32"
    optimizer: str = "adam"
    lr: float = 1e-3
    torch_threads: int = 1

    def validate(self) -> None:
        for name in ("num_gpus", "gpus_per_node", "context", "steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"workload.{name}: must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ConfigError(f"workload.warmup_steps: must be >= 0, got {self.warmup_steps}")
        if (self.global_batch_seqs > 0) == (self.token_budget > 0):
            raise ConfigError(f"workload.global_batch_seqs ({self.global_batch_seqs}) and workload.token_budget "
                              f"({self.token_budget}): set exactly one of them > 0")
        self.lengths.validate()
