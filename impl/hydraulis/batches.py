"""Hydraulis' per-step batches (as the authors' code, `examples/hydraulis/`, builds them): sample until Σ ≥ G, truncate the last
sequence so Σ = G exactly. Every Hydraulis policy and baseline draws its steps here, so all of
them consume identical batches for a (workload, seed). The substrate's stream never truncates
(a cut document is a different sample): the cut is Hydraulis' rule and lives here.
"""
from __future__ import annotations

import numpy as np

from impl.common.api import ConfigError
from impl.common.varlen.sampling import LengthStream, StepBatch


def check_budget(wl) -> None:
    """G must hold the longest sequence the workload can draw (one-line error otherwise)."""
    if wl.token_budget < 1:
        raise ConfigError(f"workload.token_budget: Hydraulis needs a fixed token budget G > 0 per step, got "
                          f"{wl.token_budget} (set workload.global_batch_seqs 0)")
    longest = wl.lengths.max_len or wl.context
    if wl.token_budget < longest:
        raise ConfigError(f"workload.token_budget: G = {wl.token_budget} is smaller than one sequence of up to "
                          f"{longest} tokens (workload.lengths.max_len / context)")


def step_batches(wl, seed: int, steps: int) -> list[StepBatch]:
    check_budget(wl)
    stream = LengthStream(wl.lengths, seed)
    out = []
    for _ in range(steps):
        b = stream.by_tokens(wl.token_budget, overflow="keep")
        lengths = b.lengths.copy()
        lengths[-1] -= int(lengths.sum()) - wl.token_budget
        if lengths[-1] < 1:  # the budget was met exactly before the last draw cannot happen with keep
            raise AssertionError("truncation left an empty sequence")
        out.append(StepBatch(b.step, b.ids, lengths.astype(np.int64)))
    return out
