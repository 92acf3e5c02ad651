"""One rank's HotSPa training engine (the authors' iteration schedule, `examples/hotspa`;
the real CPU experiment of impl/hotspa/README.md, "Real mode").

State: the fp32 master weights, Adam's state and the gradient accumulator live only in the
home layout (rank r of W holds fraction ``[r/W, (r+1)/W)`` of every tensor, see
:mod:`impl.hotspa.switching`); one compute model per strategy (a whole replica for DP, a
Megatron TP shard for TP) is a *view* filled by a parameter switch and never stepped.

A step (:meth:`RankTrainer.step`):
1. group the step's sequences by the boundaries, pack each group (:func:`hotspa_pack` to its
   bound), and deal micro-batches to DP ranks (short ranks padded with empty micro-batches);
2. for the groups from shortest to longest, then the home (longest) group last: switch the
   parameters from where they are into the group's strategy, run its forward/backward, and
   switch its gradients, reduced over the strategy's DP group, into the home accumulator;
   an empty group switches and computes nothing;
3. one Adam step in the home layout; zero the accumulator.
The loss of every micro-batch is divided by the step's global target-token count, so the
accumulated gradient is the step's gradient however the step was grouped and packed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from impl.common.models.varlen_gpt import VarlenGPT, micro_batch_tensors, step_target_tokens
from impl.common.parallel.tensor_parallel import cut_state_dict, tensor_parallel
from impl.common.runtime.rank_device import Intervals, place
from impl.common.varlen.packing import MicroBatch, assign_dp, group_by_boundaries, hotspa_pack

from impl.hotspa.strategy import GroupPlan, Strategy
from impl.hotspa.switching import HOME, SwitchCache, layout_name


@dataclass
class StepLog:
    step_s: float = 0.0
    switch_s: float = 0.0
    loss_part: float = 0.0  # this rank's share of the step loss (each micro-batch counted once)
    switches: int = 0
    switch_bytes: int = 0
    micro_batches: list = field(default_factory=list)  # (layout, tokens, sum s², seconds, tp_rank)
    # spans recorded inside the step, read after it (CUDA events need no sync inside the step)
    spans: Optional[Intervals] = field(default=None, repr=False)
    _switch_spans: list = field(default_factory=list, repr=False)
    _mb_spans: list = field(default_factory=list, repr=False)
    _losses: list = field(default_factory=list, repr=False)

    def resolve(self) -> None:
        """Turn the step's spans into seconds (after the step's closing barrier)."""
        if self.spans is None:
            return
        secs = self.spans.seconds()
        self.loss_part += float(torch.stack(self._losses).sum()) if self._losses else 0.0
        self.switch_s = sum(secs[i] for i in self._switch_spans)
        self.micro_batches = [(*row, secs[i], tp) for i, (row, tp) in zip(self._mb_spans, self.micro_batches)]
        self._switch_spans, self._mb_spans, self._losses = [], [], []
    groups_run: list = field(default_factory=list)


@dataclass
class StepBatchPlan:
    """Every group's micro-batches per DP rank (plain data: the same on every rank)."""

    groups: list  # [(group index, Strategy, [[MicroBatch] per DP rank])], longest group first
    global_tokens: int

    def all_micro_batches(self) -> list[MicroBatch]:
        return [mb for _, _, ranks in self.groups for r in ranks for mb in r]


def plan_step(ids, lengths, plan: GroupPlan, pad: str, align: int) -> StepBatchPlan:
    groups = group_by_boundaries(ids, lengths, plan.boundaries, field="system.boundaries")
    out = []
    for g, s in zip(groups, plan.strategies):
        mbs = hotspa_pack(g.seq_ids, g.lengths, g.upper, pad=pad, align=align, field="system") \
            if not g.is_empty else []
        out.append((g.index, s, assign_dp(mbs, s.dp) if mbs else [[] for _ in range(s.dp)]))
    return StepBatchPlan(out, step_target_tokens([mb for *_, rs in out for r in rs for mb in r]))


def schedule_order(n_groups: int) -> list[int]:
    """The authors' schedule: strategies 1..n-1 serve the groups from shortest to longest, home last."""
    return list(range(n_groups - 1, 0, -1)) + [0]


class RankTrainer:
    """``device``: the rank's (the launcher's ``RankContext.device``); ``dtype``: the compute
    models' (the master weights, Adam's state and the accumulator stay fp32, as in mixed precision)."""

    def __init__(self, shape, seed: int, rank: int, world: int, plan: GroupPlan, lr: float,
                 cache: SwitchCache, vocab_seed: int, device: torch.device = torch.device("cpu"),
                 dtype: str = "fp32") -> None:
        self.shape, self.rank, self.world, self.plan = shape, rank, world, plan
        self.cache, self.data_seed, self.device = cache, vocab_seed, device
        with torch.device(device):  # built where it trains (a 7B fp32 copy never on the host)
            full = VarlenGPT(shape, seed)
        shards = cut_state_dict({n: p.detach() for n, p in full.named_parameters()}, rank, world)
        del full
        self.master = {n: nn.Parameter(t) for n, t in shards.items()}
        self.home_t = {n: p.detach() for n, p in self.master.items()}
        self.acc = {n: torch.zeros_like(t) for n, t in self.home_t.items()}
        self.opt = torch.optim.Adam(list(self.master.values()), lr=lr)
        self.optimizer_steps = 0
        self.last_grads: Optional[dict] = None
        self.models: dict[str, VarlenGPT] = {}
        for s in dict.fromkeys(plan.strategies):
            with torch.device(device):
                m = VarlenGPT(shape, seed)
            if s.tp > 1:
                tensor_parallel(m, rank % s.tp, s.tp)
            self.models[layout_name(s)] = place(m, device, dtype)
        self.model_t = {lay: {n: p.detach() for n, p in m.named_parameters()} for lay, m in self.models.items()}

    def _timed_switch(self, log: StepLog, fn, *args) -> None:
        i = log.spans.begin()
        log.switch_bytes += fn(*args)
        log.spans.end(i)
        log._switch_spans.append(i)
        log.switches += 1

    def step(self, bp: StepBatchPlan, log: StepLog, keep_grads: bool = False) -> None:
        """One training step; ``keep_grads`` keeps the accumulated home gradient in ``last_grads``.
        Spans go to ``log.spans``; the caller reads them with ``log.resolve()`` after the step."""
        if log.spans is None:
            log.spans = Intervals(self.device)
        losses = []
        cur, cur_t = HOME, self.home_t
        for gi in schedule_order(len(bp.groups)):
            index, s, per_rank = bp.groups[gi]
            if not any(mb for r in per_rank for mb in r if not mb.is_empty):
                continue  # empty group: no switch, no compute, no gradient
            lay = layout_name(s)
            model, mt = self.models[lay], self.model_t[lay]
            if cur != lay:
                self._timed_switch(log, self.cache.params, cur, lay, cur_t, mt)
            for p in model.parameters():
                p.grad = None
            tp_rank = self.rank % s.tp
            for mb in per_rank[self.rank // s.tp]:
                if mb.is_empty:
                    continue  # padding micro-batch: placeholder only
                tok, tgt, cu, sl = (t.to(self.device, non_blocking=True)
                                    for t in micro_batch_tensors(mb, self.shape.vocab, self.data_seed))
                i = log.spans.begin()
                loss = model(tok, tgt, cu, sl, global_tokens=bp.global_tokens)
                loss.backward()
                log.spans.end(i)
                if tp_rank == 0:
                    losses.append(loss.detach().float())
                log._mb_spans.append(i)
                log.micro_batches.append(((lay, mb.num_tokens, int(sum(x * x for x in mb.lengths))), tp_rank))
            grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
            self._timed_switch(log, self.cache.grads, s, grads, self.acc)
            log.groups_run.append(index)
            cur, cur_t = lay, mt
        for n, p in self.master.items():
            p.grad = self.acc[n]
        # CPU copies: the checks compare them with a CPU reference outside the timed step
        self.last_grads = {n: t.detach().to("cpu", copy=True) for n, t in self.acc.items()} if keep_grads else None
        self.opt.step()
        self.optimizer_steps += 1
        log._losses = losses  # read in resolve(): no host sync inside the step
        for n, p in self.master.items():
            p.grad = None
            self.acc[n].zero_()

    def home_state(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().to("cpu", copy=True) for n, t in self.home_t.items()}

