"""Live migration of training state between two plans (Malleus's, the authors' code: Hetu
`hetu/graph/switch_exec_graph.*`), over torch.distributed.

Each rank holds the full model's *skeleton* (the tiny GPT, every parameter allocated) but
only the units its plan stage needs carry values; the others are NaN, so stale state can
never be used silently. State per parameter: the value, Adam's ``exp_avg``, ``exp_avg_sq`` and
``step``. :func:`migrate` executes :func:`impl.common.parallel.migration.plan_migration`:
units the destination already holds stay in place; the others travel as flat fp32 payloads,
batched per (src, dst) pair into rounds of at most ``bucket_bytes`` (the extra peak memory
of a migration), every rank walking the same deterministic round list. Parameters and Adam
state arrive bitwise (fp32 carries fp32 values and the integer step exactly).
"""
from __future__ import annotations

import hashlib
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from impl.common.parallel.migration import buckets, held_units, plan_migration
from impl.common.parallel.plan import Plan

STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


def unit_param_names(model: nn.Module, num_layers: int) -> dict[int, list[str]]:
    """State unit -> parameter names: -1 embeddings, 0..L-1 blocks, L final norm + head."""
    out: dict[int, list[str]] = {u: [] for u in range(-1, num_layers + 1)}
    for name, _ in model.named_parameters():
        if name.startswith(("tok_emb.", "pos_emb.")):
            out[-1].append(name)
        elif name.startswith("blocks."):
            out[int(name.split(".")[1])].append(name)
        else:
            out[num_layers].append(name)
    return out


def units_of(plan: Plan, rank: int) -> set[int]:
    return set(held_units(plan).get(rank, {}))


class RankState:
    """One rank's parameters (by full-model name) and Adam state, with the units it holds."""

    def __init__(self, model: nn.Module, num_layers: int, held: set[int]) -> None:
        self.model = model
        self.L = num_layers
        self.params = dict(model.named_parameters())
        self.device = next(iter(self.params.values())).device
        self.units = unit_param_names(model, num_layers)
        self.held = set(held)
        self.opt_state: dict[str, dict[str, torch.Tensor]] = {}
        self._blank_unheld()

    def names(self, units) -> list[str]:
        return [n for u in sorted(units) for n in self.units[u]]

    def _blank_unheld(self) -> None:
        with torch.no_grad():
            for u, names in self.units.items():
                if u not in self.held:
                    for n in names:
                        self.params[n].fill_(float("nan"))
                        self.params[n].grad = None
                        self.opt_state.pop(n, None)

    def payload(self, unit: int) -> torch.Tensor:
        parts = []
        for n in self.units[unit]:
            parts.append(self.params[n].detach().reshape(-1).float())
            st = self.opt_state.get(n)
            if st:
                parts += [st["exp_avg"].reshape(-1), st["exp_avg_sq"].reshape(-1), st["step"].reshape(-1).float().to(self.device)]
        return torch.cat(parts) if parts else torch.empty(0, device=self.device)

    def payload_numel(self, unit: int, with_state: bool) -> int:
        per = sum(self.params[n].numel() for n in self.units[unit])
        return per * (3 if with_state else 1) + (len(self.units[unit]) if with_state else 0)

    def load(self, unit: int, flat: torch.Tensor, with_state: bool) -> None:
        off = 0
        with torch.no_grad():
            for n in self.units[unit]:
                p = self.params[n]
                k = p.numel()
                p.copy_(flat[off:off + k].view_as(p))
                off += k
                if with_state:
                    ea = flat[off:off + k].view_as(p).clone()
                    off += k
                    eas = flat[off:off + k].view_as(p).clone()
                    off += k
                    step = flat[off:off + 1].reshape(()).clone()
                    off += 1
                    self.opt_state[n] = {"step": step, "exp_avg": ea, "exp_avg_sq": eas}

    def digest(self, units) -> dict[int, str]:
        """sha256 per unit over params and Adam state bytes (bitwise comparisons)."""
        out = {}
        for u in sorted(units):
            h = hashlib.sha256()
            for n in self.units[u]:
                h.update(n.encode())
                h.update(self.params[n].detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
                st = self.opt_state.get(n)
                for k in STATE_KEYS:
                    if st:
                        h.update(st[k].detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
            out[u] = h.hexdigest()
        return out


def migrate(state: RankState, old: Plan, new: Plan, rank: int, bucket_bytes: float,
            with_state: bool, group=None) -> dict:
    """Move state from ``old`` to ``new`` (collective over every rank in ``group``/world)."""
    numel = {u: state.payload_numel(u, with_state) for u in state.units}
    transfers, summary = plan_migration(old, new, lambda u: 4.0 * numel[u])
    rounds = buckets(transfers, bucket_bytes)
    received: dict[int, torch.Tensor] = {}
    peak = 0.0
    for rnd in rounds:
        ops, recv_bufs = [], []
        for t in rnd:
            if t.src == rank:
                ops.append(dist.P2POp(dist.isend, state.payload(t.unit).contiguous(), t.dst, group))
            elif t.dst == rank:
                buf = torch.empty(numel[t.unit], dtype=torch.float32, device=state.device)
                recv_bufs.append((t.unit, buf))
                ops.append(dist.P2POp(dist.irecv, buf, t.src, group))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        peak = max(peak, sum(b.numel() * 4.0 for _, b in recv_bufs))
        for u, buf in recv_bufs:
            received[u] = buf
    for u, buf in received.items():
        state.load(u, buf, with_state)
    state.held = units_of(new, rank)
    state._blank_unheld()
    summary.update({"rounds": len(rounds), "peak_recv_bytes": peak, "received_units": sorted(received)})
    return summary


def build_optimizer(state: RankState, name: str, lr: float):
    """The reference's optimizer over the held parameters, with their migrated Adam state."""
    from impl.common.models.tiny_gpt import make_optimizer

    params = [state.params[n] for n in state.names(state.held)]
    if not params:  # a suspended rank holds nothing and steps nothing
        return None
    opt = make_optimizer(params, name, lr)
    for n in state.names(state.held):
        st = state.opt_state.get(n)
        if st is not None and name == "adam":
            # Adam keeps its step count on the CPU (capturable=False), wherever the weights are
            opt.state[state.params[n]] = {"step": st["step"].to("cpu", copy=True), "exp_avg": st["exp_avg"].clone(),
                                         "exp_avg_sq": st["exp_avg_sq"].clone()}
    return opt


def save_optimizer(state: RankState, opt) -> None:
    """Copy the optimizer's per-parameter state back into ``state.opt_state`` (by name)."""
    if opt is None:
        return
    for n in state.names(state.held):
        st = opt.state.get(state.params[n])
        if st:
            state.opt_state[n] = {"step": st["step"].detach().clone().float().reshape(()),
                                  "exp_avg": st["exp_avg"].detach().clone(),
                                  "exp_avg_sq": st["exp_avg_sq"].detach().clone()}
