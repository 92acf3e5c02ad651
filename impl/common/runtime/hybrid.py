"""DP x PP training (NCCL on GPUs or gloo on the CPU, from the job's execution decision) with non-uniform plans, weighted gradients and live migration.

One process per "GPU" (``num_gpus`` ranks). Each iteration:

1. rank 0's controller (:class:`Controller`, e.g. Malleus's policy with its asynchronous
   planner) may hand out a new :class:`~impl.common.parallel.plan.Plan`; it is broadcast and,
   if it differs, every rank migrates parameters and Adam state to it
   (:func:`impl.common.runtime.migrate.migrate`) at this iteration boundary;
2. ranks align (a world all-reduce), then each active rank runs its pipeline's 1F1B over the
   micro-batches ``[off_i, off_i + m_i)`` of the iteration's global batch (one global
   sampler; the consumed-sample counter advances by M*mbs per iteration whatever the plan),
   with P2P isend/recv between its stages. Every F/B op is padded (sleep) to ``layers * pad * x``
   where x is the rank's injected slowdown (Malleus's real CPU mode [R], impl/malleus/README.md);
   the padded op time is the rank's compute time T_g. Suspended ranks run the GEMM probe instead;
3. each micro-batch's loss is scaled by 1/M (M = global micro-batches), so adding every
   replica's accumulated gradients gives the per-sample mean over the global batch (never
   a mean of replica means); the sum is one all-reduce of a flat full-model vector over the
   active ranks (zeros where a rank holds nothing: exact), then each holder steps Adam;
4. compute times, probe times, losses and each rank's elapsed time go to rank 0 (control
   traffic, not training).

Every rank measures its own wall time from the aligned start (the world all-reduce every
rank joins, suspended or not) to the end of its work for the iteration (optimizer step for
active ranks, the probe for suspended ones); the iteration time is the maximum over ranks,
i.e. until the last rank finishes (``rank_times_s`` in each report keeps the per-rank
values). Errors in any rank end the run with one line naming the rank.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from impl.common.api import ConfigError
from impl.common.fault_model.compute_slowdown import slowdown_at
from impl.common.models.tiny_gpt import TinyGPT, embed, lm_loss, make_microbatches
from impl.common.parallel.plan import Plan
from impl.common.workloads.pipeline import ModelShape

from .launch import RankContext, launch
from .migrate import RankState, build_optimizer, migrate, save_optimizer, units_of
from impl.common.execution import set_torch_threads


@dataclass
class HybridRunConfig:
    shape: ModelShape
    num_gpus: int
    micro_batch_size: int
    num_microbatches: int
    iterations: int  # total, warm-up included
    seed: int
    initial_plan: dict
    fault: Any = None  # impl.common.fault_model.spec.ComputeSlowdown or None
    layer_fwd_pad_s: float = 0.0
    layer_bwd_pad_s: float = 0.0
    optimizer: str = "adam"
    lr: float = 1e-3
    bucket_bytes: float = 1 << 20
    torch_threads: int = 1
    verify_migration: bool = True
    collect_params: bool = False
    timeout_s: float = 600.0


class Controller:
    """Runs on rank 0 only. ``decide`` sees the previous iteration's report and returns the
    plan for ``iteration`` (or None = keep). Subclasses may plan in a background thread."""

    def decide(self, iteration: int, current: Plan, report: Optional[dict]) -> Optional[Plan]:
        return None

    def close(self) -> None:
        pass


@dataclass
class FixedPlans(Controller):
    """``plans[i]`` from iteration i on (the last one holds): scripted re-plans for tests."""

    plans: list = field(default_factory=list)

    def decide(self, iteration, current, report):
        if not self.plans:
            return None
        return Plan.from_dict(self.plans[min(iteration, len(self.plans) - 1)])


class HybridStage(nn.Module):
    """Layers [lo, hi) of the skeleton, plus embeddings (first) / final norm + head (last)."""

    def __init__(self, full: TinyGPT, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.full, self.lo, self.hi, self.first, self.last = full, lo, hi, first, last

    def forward(self, inp, targets=None):
        f = self.full
        x = embed(f.tok_emb, f.pos_emb, inp) if self.first else inp
        for i in range(self.lo, self.hi):
            x = f.blocks[i](x)
        return lm_loss(f.ln_f, f.head, x, targets) if self.last else x


def _sleep_until(t_end: float) -> None:
    while True:
        left = t_end - time.perf_counter()
        if left <= 0:
            return
        time.sleep(left)


def _sync(device: torch.device) -> None:
    """The straggler emulation pads on the host: the device's queued work must be done first."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe_once(x: float, hidden: int, reps: int = 20, device: torch.device = torch.device("cpu")) -> float:
    """Suspended GPU's probe: ``reps`` small GEMM chains on the rank's device, padded by the
    slowdown like ops."""
    a = torch.ones(8, hidden, device=device)
    w1 = torch.ones(hidden, 4 * hidden, device=device) * 1e-3
    w2 = torch.ones(4 * hidden, hidden, device=device) * 1e-3
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a = (a @ w1) @ w2
    _sync(device)
    raw = time.perf_counter() - t0
    _sleep_until(t0 + raw * x)
    return time.perf_counter() - t0


class _Worker:
    """One rank on ``device`` (the launcher's: ``cuda:<local rank>`` under NCCL, else the CPU)."""

    def __init__(self, rank: int, cfg: HybridRunConfig, controller: Optional[Controller],
                 device: torch.device = torch.device("cpu")):
        self.rank, self.cfg, self.device = rank, cfg, device
        set_torch_threads(cfg.torch_threads)
        self.controller = controller if rank == 0 else None
        # the seeded initial state, drawn on the CPU so every rank (and the single-process
        # reference) starts from the same weights whatever its device, then moved there
        self.full = TinyGPT(cfg.shape, cfg.seed).to(device)
        self.plan = Plan.from_dict(cfg.initial_plan)
        self.state = RankState(self.full, cfg.shape.num_layers, units_of(self.plan, rank))
        self.opt = build_optimizer(self.state, cfg.optimizer, cfg.lr)
        self._groups: dict = {}
        self.flat_names = [n for n, _ in self.full.named_parameters()]

    def active_group(self, plan: Plan):
        key = plan.active_gpus
        if key not in self._groups:  # collective: every rank creates every group, same order
            self._groups[key] = dist.new_group(list(key))
        return self._groups[key]

    # -- one iteration -------------------------------------------------------------------
    def _slowdown(self, it: int) -> float:
        if self.cfg.fault is None:
            return 1.0
        return slowdown_at(self.cfg.fault, it, self.cfg.num_gpus)[self.rank]

    def run_iteration(self, it: int, x: float) -> dict:
        cfg, plan = self.cfg, self.plan
        me = plan.gpu_layout().get(self.rank)
        dev = self.device
        batches = [(a.to(dev), b.to(dev)) for a, b in
                   make_microbatches(cfg.shape, cfg.micro_batch_size, cfg.num_microbatches, cfg.seed, it)]
        compute_s, probe_s, losses = 0.0, None, {}
        if me is None:
            probe_s = probe_once(x, cfg.shape.hidden, device=dev)
        else:
            i, j = me["pipeline"], me["stage"]
            pipe = plan.pipelines[i]
            S, m = pipe.num_stages, pipe.micro_batches
            off = sum(p.micro_batches for p in plan.pipelines[:i])
            lo, hi = me["layers"]
            stage = HybridStage(self.full, lo, hi, j == 0, j == S - 1)
            gpu_of = lambda jj: plan.groups[pipe.groups[jj]].gpus[0]  # noqa: E731
            prev_rank = gpu_of(j - 1) if j > 0 else None
            next_rank = gpu_of(j + 1) if j < S - 1 else None
            shape = (cfg.micro_batch_size, cfg.shape.seq_len, cfg.shape.hidden)
            saved, sends = {}, []
            f_pad = (hi - lo) * cfg.layer_fwd_pad_s * x
            b_pad = (hi - lo) * cfg.layer_bwd_pad_s * x

            def fwd(k: int) -> float:
                tokens, targets = batches[off + k]
                if j == 0:
                    inp = tokens
                else:
                    inp = torch.empty(shape, device=dev)
                    dist.recv(inp, prev_rank)
                    inp.requires_grad_(True)
                t0 = time.perf_counter()
                out = stage(inp, targets) if j == S - 1 else stage(inp)
                if j == S - 1:
                    losses[off + k] = out.detach()  # read after the iteration: no sync here
                    out = out / cfg.num_microbatches  # per-sample weight of the global batch
                else:
                    sends.append(dist.isend(out.detach().contiguous(), next_rank))
                saved[k] = (inp, out)
                _sync(dev)
                _sleep_until(t0 + f_pad)
                return time.perf_counter() - t0

            def bwd(k: int) -> float:
                inp, out = saved.pop(k)
                grad = None
                if j < S - 1:
                    grad = torch.empty(shape, device=dev)
                    dist.recv(grad, next_rank)
                t0 = time.perf_counter()
                torch.autograd.backward(out, grad_tensors=grad)
                if j > 0:
                    sends.append(dist.isend(inp.grad.contiguous(), prev_rank))
                _sync(dev)
                _sleep_until(t0 + b_pad)
                return time.perf_counter() - t0

            warm = min(S - j - 1, m)
            for k in range(warm):
                compute_s += fwd(k)
            for k in range(m - warm):
                compute_s += fwd(warm + k)
                compute_s += bwd(k)
            for k in range(m - warm, m):
                compute_s += bwd(k)
            for s in sends:
                s.wait()
        # weighted gradient sum over the active ranks (flat, zeros where not held: exact)
        if me is not None:
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              if n in self._held_names else torch.zeros(p.numel(), device=dev)
                              for n, p in self.full.named_parameters()])
            dist.all_reduce(flat, group=self.active_group(plan))
            off = 0
            for n, p in self.full.named_parameters():
                k = p.numel()
                if n in self._held_names:
                    p.grad = flat[off:off + k].view_as(p).clone()
                off += k
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        _sync(dev)
        return {"compute_s": compute_s, "probe_s": probe_s, "losses": {k: float(v) for k, v in losses.items()}}

    @property
    def _held_names(self) -> set:
        if getattr(self, "_hn_key", None) != id(self.plan):
            self._hn = set(self.state.names(self.state.held))
            self._hn_key = id(self.plan)
        return self._hn

    # -- the run -------------------------------------------------------------------------
    def run(self) -> Optional[dict]:
        cfg = self.cfg
        out = {"iteration_times_s": [], "losses": [], "plans": [], "reports": [], "migrations": [],
               "consumed": [], "migration_checks": 0}
        report = None
        consumed = 0
        self.active_group(self.plan)
        for it in range(cfg.iterations):
            # 1. plan for this iteration (rank 0 decides, everyone follows)
            box = [None]
            if self.rank == 0:
                new = self.controller.decide(it, self.plan, report) if self.controller else None
                box = [None if new is None or new.signature() == self.plan.signature() else new.to_dict()]
            dist.broadcast_object_list(box, src=0)
            if box[0] is not None:
                new = Plan.from_dict(box[0])
                self.active_group(new)
                save_optimizer(self.state, self.opt)
                before = self.state.digest(self.state.held) if cfg.verify_migration else None
                t0 = time.perf_counter()
                summ = migrate(self.state, self.plan, new, self.rank, cfg.bucket_bytes,
                               with_state=it > 0 and cfg.optimizer == "adam")
                mig_s = time.perf_counter() - t0
                self.plan = new
                self.opt = build_optimizer(self.state, cfg.optimizer, cfg.lr)
                if cfg.verify_migration:
                    after = self.state.digest(self.state.held)
                    gathered = [None] * cfg.num_gpus
                    dist.all_gather_object(gathered, (before, after))
                    if self.rank == 0:
                        out["migration_checks"] += _check_digests(gathered)
                if self.rank == 0:
                    out["migrations"].append({"iteration": it, "seconds": mig_s, **{k: v for k, v in summ.items()
                                                                                      if k != "received_units"}})
            # 2. aligned start, the iteration, weighted gradient sum, optimizer step
            x = self._slowdown(it)
            flag = torch.zeros(1, device=self.device)
            dist.all_reduce(flag)
            t0 = time.perf_counter()
            res = self.run_iteration(it, x)
            t_rank = time.perf_counter() - t0  # this rank's elapsed time from the aligned start
            gathered = [None] * cfg.num_gpus
            dist.all_gather_object(gathered, (res["compute_s"], res["probe_s"], res["losses"], t_rank))
            if self.rank == 0:
                losses: dict = {}
                for g in gathered:
                    losses.update(g[2])
                rank_times = [g[3] for g in gathered]
                t_iter = max(rank_times)  # until the last rank finishes its work
                lay = self.plan.gpu_layout()
                report = {"iteration": it, "compute_s": [g[0] for g in gathered], "probe_s": [g[1] for g in gathered],
                          "layout": {d: (e["layers"][1] - e["layers"][0], self.plan.pipelines[e["pipeline"]].micro_batches,
                                         e["tp_size"]) for d, e in lay.items()},
                          "suspended": list(self.plan.suspended), "rank_times_s": rank_times,
                          "iteration_time_s": t_iter}
                out["iteration_times_s"].append(t_iter)
                out["losses"].append([losses[k] for k in sorted(losses)])
                out["plans"].append(self.plan.to_dict())
                out["reports"].append({k: v for k, v in report.items() if k != "layout"})
                ranges, off = [], consumed
                for p in self.plan.pipelines:
                    ranges.append([off, off + p.micro_batches * cfg.micro_batch_size])
                    off += p.micro_batches * cfg.micro_batch_size
                out["consumed"].append(ranges)
                consumed = off
        if cfg.collect_params:
            mine = {n: self.state.params[n].detach().to("cpu", copy=True) for n in self.state.names(self.state.held)}
            gathered = [None] * cfg.num_gpus
            dist.all_gather_object(gathered, mine)
            if self.rank == 0:
                params = {}
                for d in gathered:
                    for n, t in d.items():
                        if n in params and not torch.equal(params[n], t):
                            raise RuntimeError(f"replicas of {n} differ after training")
                        params[n] = t
                out["params"] = params
        if self.controller is not None:
            self.controller.close()
            out["controller"] = getattr(self.controller, "summary", lambda: {})()
        dist.barrier()
        return out if self.rank == 0 else None


def _check_digests(gathered) -> int:
    """Every unit a rank holds after migration equals (bitwise) what its old holders had."""
    old: dict[int, set] = {}
    for before, _ in gathered:
        for u, h in before.items():
            old.setdefault(u, set()).add(h)
    n = 0
    for r, (_, after) in enumerate(gathered):
        for u, h in after.items():
            if old.get(u) != {h}:
                raise RuntimeError(f"migration: rank {r} unit {u} differs from its old holders (or the replicas disagreed)")
            n += 1
    return n


def _worker_main(ctx: RankContext, cfg: HybridRunConfig, controller: Optional[Controller]) -> Optional[dict]:
    return _Worker(ctx.rank, cfg, controller, ctx.device).run()


def run_hybrid(cfg: HybridRunConfig, controller: Optional[Controller] = None) -> dict:
    """Run ``cfg.num_gpus`` ranks (local processes, or torchrun's); return rank 0's record
    (times, losses, plans, reports). ``controller`` acts on rank 0 only."""
    if cfg.num_gpus < 1:
        raise ConfigError(f"num_gpus must be >= 1, got {cfg.num_gpus}")
    # backend None: the job's execution decision (one GPU per rank over NCCL, else gloo on the CPU)
    run = launch(_worker_main, cfg.num_gpus, (cfg, controller), label="hybrid", backend=None,
                 pg_timeout_s=cfg.timeout_s, timeout_s=cfg.timeout_s)
    return run.results[0]
