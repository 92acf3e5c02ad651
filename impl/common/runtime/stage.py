"""One pipeline stage's compute: F, B, W and BW on micro-batches, no communication.

The executor drives a :class:`StageRunner` from a schedule; tests can drive several in one
process in any valid order. Gradients are accumulated in **micro-batch-id order** whatever
order B and W run in (contributions that arrive early wait in a small buffer), so loss, grads
and parameters are bitwise identical across schedules and equal to the single-process
reference.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from impl.common.models.tiny_gpt import PipelineStage, scale_loss
from impl.common.models.bw_split import (WeightGradStash, accumulate_grad, defer_weight_grads,
                                         split_linear_params)


class _OrderedAccumulator:
    """Adds per-micro-batch gradient contributions into ``.grad`` in micro-batch order."""

    def __init__(self, num_microbatches: int) -> None:
        self.n = num_microbatches
        self.next_mb = 0
        self.pending: dict[int, list[tuple[nn.Parameter, torch.Tensor]]] = {}

    def add(self, mb: int, contribs: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        if mb in self.pending or mb < self.next_mb:
            raise RuntimeError(f"gradient of micro-batch {mb} accumulated twice")
        self.pending[mb] = contribs
        while self.next_mb in self.pending:
            for p, g in self.pending.pop(self.next_mb):
                accumulate_grad(p, g)
            self.next_mb += 1

    def complete(self) -> bool:
        return self.next_mb == self.n and not self.pending

    def reset(self) -> None:
        self.next_mb = 0
        self.pending.clear()


class StageRunner:
    """Runs F/B/W/BW of one stage. ``forward`` returns the activation to send (or None on
    the last stage); ``backward_input`` returns the input gradient to send (None on the
    first stage)."""

    def __init__(self, stage: PipelineStage, num_microbatches: int) -> None:
        self.stage = stage
        self.n = num_microbatches
        split_ids = split_linear_params(stage)
        self.split_params = [p for p in stage.parameters() if id(p) in split_ids]
        self.other_params = [p for p in stage.parameters() if id(p) not in split_ids]
        self._acc_b = _OrderedAccumulator(num_microbatches)  # params whose grad B produces
        self._acc_w = _OrderedAccumulator(num_microbatches)  # SplitLinear params (W)
        self._saved: dict[int, tuple[Optional[torch.Tensor], torch.Tensor]] = {}
        self._stash: dict[int, WeightGradStash] = {}
        self._done: dict[str, set[int]] = {"F": set(), "B": set(), "W": set()}
        self.losses: dict[int, torch.Tensor] = {}
        self.in_flight = 0  # micro-batches with F done and B not yet
        self.peak_in_flight = 0

    # -- ops --------------------------------------------------------------------------
    def forward(self, mb: int, inp: torch.Tensor, targets: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        self._check(mb, "F", needs=None)
        if not self.stage.is_first:
            inp = inp.detach().requires_grad_(True)
        stash = WeightGradStash()
        with defer_weight_grads(stash):
            out = self.stage(inp, targets) if self.stage.is_last else self.stage(inp)
        if self.stage.is_last:
            self.losses[mb] = out.detach()
            out = scale_loss(out, self.n)
        self._saved[mb] = (None if self.stage.is_first else inp, out)
        self._stash[mb] = stash
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return None if self.stage.is_last else out.detach()

    def backward_input(self, mb: int, grad_output: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """B: input gradient now; weight gradients of SplitLinear layers deferred to W."""
        self._check(mb, "B", needs="F")
        inp, out = self._saved.pop(mb)
        if self.stage.is_last:
            grad_output = None  # d(scaled loss)/d(scaled loss) = 1, as in .backward()
        elif grad_output is None:
            raise RuntimeError(f"stage {self.stage.stage}: B{mb} needs the output gradient")
        inputs = ([] if inp is None else [inp]) + self.other_params
        if inputs:
            grads = torch.autograd.grad(out, inputs, grad_outputs=grad_output)
        else:  # nothing but deferred weights: still run backward to fill the stash
            torch.autograd.backward(out, grad_tensors=grad_output)
            grads = ()
        grad_input = None if inp is None else grads[0]
        own = grads[0 if inp is None else 1:]
        self._acc_b.add(mb, list(zip(self.other_params, own)))
        self.in_flight -= 1
        return grad_input

    def backward_weight(self, mb: int) -> None:
        """W: weight gradients from the (x, grad_out) pairs B recorded."""
        self._check(mb, "W", needs="B")
        self._acc_w.add(mb, self._stash.pop(mb).compute())

    def backward_full(self, mb: int, grad_output: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """BW: B and W back to back (1F1B / GPipe)."""
        grad_input = self.backward_input(mb, grad_output)
        self.backward_weight(mb)
        return grad_input

    # -- iteration boundary -----------------------------------------------------------
    def finish_iteration(self) -> list[float]:
        """Check every F/B/W ran once and all gradients landed; return losses (last stage)."""
        for op, done in self._done.items():
            if len(done) != self.n:
                missing = sorted(set(range(self.n)) - done)
                raise RuntimeError(f"stage {self.stage.stage}: {op} never ran for micro-batches {missing}")
        if not (self._acc_b.complete() and self._acc_w.complete()):
            raise RuntimeError(f"stage {self.stage.stage}: gradients of some micro-batches never accumulated")
        losses = [float(self.losses[j]) for j in range(self.n)] if self.stage.is_last else []
        self.losses.clear()
        for done in self._done.values():
            done.clear()
        self._acc_b.reset()
        self._acc_w.reset()
        self.in_flight = 0
        return losses

    def _check(self, mb: int, op: str, needs: Optional[str]) -> None:
        if not 0 <= mb < self.n:
            raise RuntimeError(f"stage {self.stage.stage}: {op}{mb} is outside micro-batches 0..{self.n - 1}")
        if mb in self._done[op]:
            raise RuntimeError(f"stage {self.stage.stage}: {op}{mb} ran twice in one iteration")
        if needs is not None and mb not in self._done[needs]:
            raise RuntimeError(f"stage {self.stage.stage}: {op}{mb} ran before {needs}{mb}")
        self._done[op].add(mb)
