"""The Megatron-like baseline by the HotSPa authors' grid rule (:mod:`impl.common.megatron.grid`), as
both HotSPa (``megatron_grid``) and Hydraulis (``megatron_grid_like``) run it: search the grid on
the planning steps, then price every step under the winner with the Megatron step model.

The two papers' steps differ, hence :attr:`GridRuleConfig.token_budget_steps`: HotSPa's steps
hold a fixed number of sequences, which is the fork's global batch as is; Hydraulis' steps are a
token budget (a varying sequence count), so the global batch is fixed at 32 sequences per GPU and
each step's documents are padded with zero-length ones to a multiple of dp x mbs.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from impl.common.errors import ConfigError
from impl.common.megatron.grid import MBS, GridLayout, candidates, model_of, step_prices

SEQS_PER_GPU = 32  # the global batch of token-budget steps: sequences per GPU


@dataclass(frozen=True)
class GridRuleConfig:
    token_budget_steps: bool = False

    def __post_init__(self):
        if not isinstance(self.token_budget_steps, bool):
            raise ConfigError(f"system.sim.token_budget_steps: must be true or false, got {self.token_budget_steps!r}")


class _Docs:
    def __init__(self, lengths):
        self.lengths = lengths


def padded_docs(lengths: Sequence[int], multiple: int) -> list:
    """The step's documents padded with zero-length ones to a multiple of ``multiple`` (= dp x
    mbs: the fork's global batch is a sequence count, token-budget steps are not).
    The zeros sit at evenly spaced slots, so every rank's consecutive share keeps its part of
    the real documents; a zero adds no rows and no attention, and a micro-batch of zeros only
    is priced at zero by the step model."""
    n = len(lengths)
    m = -(-n // multiple) * multiple
    z = m - n
    zero = {int((i + 0.5) * m / z) for i in range(z)} if z else set()
    it = iter(int(x) for x in lengths)
    return [0 if k in zero else next(it) for k in range(m)]


@dataclass
class GridRule:
    """The grid-rule baseline of one job: :meth:`search` picks the layout, :meth:`estimates`
    prices steps under it (the step model's estimates, one per step)."""

    cfg: GridRuleConfig
    wl: object
    hw: object

    def __post_init__(self):
        self.model = model_of(self.wl)

    def _estimate(self, g: GridLayout, batch):
        if self.cfg.token_budget_steps:
            batch = _Docs(padded_docs(batch.lengths.tolist(), g.dp * g.mbs))
        return step_prices(self.model, g, [batch], self.wl.context, self.hw, self.wl.gpus_per_node)

    def _score(self, g: GridLayout, sample) -> tuple[bool, float]:
        """(fits every planning step, mean step time) of layout ``g``."""
        if self.cfg.token_budget_steps:  # each step padded on its own
            es = [self._estimate(g, b) for b in sample]
            return all(e.fits for e in es), statistics.fmean(e.iteration_s for e in es)
        est = step_prices(self.model, g, sample, self.wl.context, self.hw, self.wl.gpus_per_node)
        return est.fits, est.iteration_s

    def search(self, sample) -> tuple[GridLayout, dict]:
        """The fastest fitting layout on ``sample`` (ties to the smaller (dp, tp, pp, mbs)) and
        what the search saw."""
        wl, hw = self.wl, self.hw
        gbs = wl.num_gpus * SEQS_PER_GPU if self.cfg.token_budget_steps else len(sample[0].lengths)
        grid = candidates(wl.num_gpus, wl.gpus_per_node, self.model.num_layers, self.model.heads, gbs)
        scores = {}
        for g in grid:
            fits, t = self._score(g, sample)
            if fits:
                scores[g] = t
        if not scores:
            raise ConfigError(f"workload.context: no layout of the grid rule fits {wl.context} tokens on {hw.name} "
                              f"({len(grid)} tried, tp up to {max(c.tp for c in grid)}, mbs {MBS})")
        best = min(scores, key=lambda g: (scores[g], g.dp, g.tp, g.pp, g.mbs))
        return best, {"grid_tried": len(grid), "grid_fit": len(scores),
                      "grid_top5": {str(g): round(scores[g], 4) for g in sorted(scores, key=scores.get)[:5]}}

    def estimates(self, best: GridLayout, batches) -> list:
        return [self._estimate(best, b) for b in batches]
