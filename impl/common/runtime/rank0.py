"""Rank 0 of a paper-scale layout on one host: estimated (``execution=estimate``) or run (``execution=rank0``).

Both build rank 0 as Megatron-LM builds it (:mod:`impl.common.parallel.megatron_rank`) inside a
process group of the layout's world size that is torch's *fake* process group
(``torch.testing._internal.distributed.fake_pg.FakeStore``, backend ``fake``: every collective
returns at once, nothing is sent), and train it for a few steps on the given micro-batches:

* ``estimate``: under ``FakeTensorMode`` (no tensor is allocated, any host, the CPU included)
  with torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``, the estimator torchtitan
  and FSDP2 use) counting every storage by kind (parameters, gradients, activations, temporaries,
  optimizer state) and by module. Its peak is rank 0's peak of the same code on a GPU, less what
  the allocator adds (fragmentation, workspaces) and the collectives' own buffers.
* ``rank0``: the same rank for real on one GPU (the collectives still fake): CUDA-event step
  times and ``torch.cuda.max_memory_allocated``.

What the fake process group stands in for is listed in :attr:`Rank0Result.emulated`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from impl.common.api import ConfigError
from impl.common.parallel.megatron_rank import RankOptimizer, RankStack, build_rank


class Rank0Kind(StrEnum):
    ESTIMATE = "estimate"
    RANK0 = "rank0"


@dataclass
class Rank0Result:
    kind: str
    world: int
    peak_memory_bytes: int
    peak_by_kind: dict  # Parameter / Gradient / Activation / Temp / Optstate / Other -> bytes at the peak
    peak_by_module: dict  # module name -> its own peak (forward or backward) in bytes
    step_s: list = field(default_factory=list)  # rank0 only: CUDA-event seconds per step
    emulated: list = field(default_factory=list)


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0):
    """This process as ``rank`` of ``world`` over torch's fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError("execution: a rank-0 estimate needs a process without a process group "
                          "(one is already initialised)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _inputs(docs: Sequence[int], vocab: int, device) -> tuple:
    n = int(sum(docs))
    tokens = torch.randint(0, vocab, (n,), device=device)
    targets = torch.randint(0, vocab, (n,), device=device)
    positions = torch.cat([torch.arange(int(d), device=device) for d in docs])
    cu = [0]
    for d in docs:
        cu.append(cu[-1] + int(d))
    return tokens, targets, positions, cu


def _task_rows(docs: Sequence[int], tasks: int) -> tuple:
    """Documents dealt to the LoRA tasks in order (doc i -> task i % tasks), as token ranges:
    the micro-batch's rows are sorted by task, as LobRA's fused step sorts them."""
    per = [0] * max(tasks, 1)
    for i, d in enumerate(docs):
        per[i % len(per)] += int(d)
    rows, a = [], 0
    for n in per:
        rows.append((a, a + n))
        a += n
    return tuple(rows)


def _module_peaks(mt) -> dict:
    from torch.distributed._tools.mem_tracker import _ModState

    out = {}
    for mod, stats in mt.memory_tracking.items():
        name = stats.mod_fqn.partition(".")[2] or "model"
        if name.count(".") > 1:  # the model, its direct children and each layer as a whole
            continue
        best = 0
        for state in (_ModState.PEAK_FW, _ModState.PEAK_BW):
            for snap in stats.snapshots.get(state, []):
                best = max(best, sum(d.get("Total", 0) for d in snap.values()))
        out[name] = best
    return out


def _merge_max(into: dict, new: dict) -> None:
    for k, v in new.items():
        into[k] = max(into.get(k, 0), v)


def run_rank0(shape, stack: RankStack, micro_batches: Sequence[Sequence[int]], kind: Rank0Kind, *,
              steps: int = 2, lr: float = 1e-4, lora_alpha: float = 16.0, fake_tensors: bool = True) -> Rank0Result:
    """Rank 0 of ``stack``'s layout training ``steps`` steps, each over ``micro_batches`` (one list
    of packed document lengths per micro-batch), estimated or run per ``kind``. ``fake_tensors``
    False tracks an estimate over real CPU tensors (the check that FakeTensorMode changes nothing)."""
    kind = Rank0Kind(kind)
    if not micro_batches or any(not mb or min(mb) < 1 for mb in micro_batches):
        raise ConfigError(f"micro_batches: need at least one micro-batch of documents >= 1 token, got {micro_batches}")
    if kind is Rank0Kind.RANK0 and not torch.cuda.is_available():
        raise ConfigError("execution=rank0: runs rank 0 for real on one GPU; no CUDA device is visible")
    emulated = [f"the other {stack.world - 1} ranks of the {stack.world}-GPU layout (tp {stack.tp} x dp {stack.dp}): "
                f"torch's fake process group, every collective returns without sending"] if stack.world > 1 else []
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = torch.device("cuda", 0) if kind is Rank0Kind.RANK0 else torch.device("cpu")
    if kind is Rank0Kind.ESTIMATE:
        emulated.append("rank 0's tensors: FakeTensorMode (shapes and dtypes only, nothing allocated); "
                        "memory by torch's MemTracker")
    mode = FakeTensorMode() if kind is Rank0Kind.ESTIMATE and fake_tensors else contextlib.nullcontext()
    step_s: list = []
    with fake_world(stack.world), mode:
        tp_group = dist.new_group(list(range(stack.tp))) if stack.tp > 1 else None
        dp_group = dist.new_group(list(range(0, stack.world, stack.tp))) if stack.dp > 1 else None
        if kind is Rank0Kind.RANK0:
            torch.cuda.reset_peak_memory_stats(device)
        model = build_rank(shape, stack, 0, tp_group, device, lora_alpha)
        trainer = RankOptimizer(model, lr, dp_group)
        batches = [(_inputs(mb, shape.vocab, device), _task_rows(mb, stack.lora_tasks)) for mb in micro_batches]
        denom = int(sum(sum(mb) for mb in micro_batches))
        mt = MemTracker() if kind is Rank0Kind.ESTIMATE else None
        by_module: dict = {}
        if mt is not None:
            mt.track_external(model, trainer.opt, trainer.main_grad, trainer.master)
        with (mt if mt is not None else contextlib.nullcontext()):
            for _ in range(steps):
                if kind is Rank0Kind.RANK0:
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                for (tokens, targets, positions, cu), rows in batches:
                    if mt is not None:  # module stats hold one call each: keep each module's max, then clear
                        _merge_max(by_module, _module_peaks(mt))
                        mt.reset_mod_stats()
                    model(tokens, targets, positions, cu, rows, denom).backward()
                trainer.step()
                if kind is Rank0Kind.RANK0:
                    b.record()
                    torch.cuda.synchronize()
                    step_s.append(a.elapsed_time(b) / 1e3)
        if mt is not None:
            peak_snap = mt.get_tracker_snapshot("peak")
            peak = int(sum(d.get("Total", 0) for d in peak_snap.values()))
            by_kind: dict = {}
            for d in peak_snap.values():
                for k, v in d.items():
                    if k != "Total":
                        by_kind[str(getattr(k, "value", k))] = by_kind.get(str(getattr(k, "value", k)), 0) + int(v)
            _merge_max(by_module, _module_peaks(mt))
        else:
            peak = int(torch.cuda.max_memory_allocated(device))
            by_kind = {}
    return Rank0Result(kind=str(kind), world=stack.world, peak_memory_bytes=peak, peak_by_kind=by_kind,
                       peak_by_module=by_module, step_s=step_s, emulated=emulated)


def predicted_peak_bytes(shape, stack: RankStack, micro_batches: Sequence[Sequence[int]], hw,
                         context: Optional[int] = None) -> float:
    """The step model's peak allocated bytes of the same rank (stage 0 of a static Megatron
    launch with this stack, every DP rank given the same micro-batches)."""
    from impl.common.megatron.model import MegatronLayout, MegatronModel
    from impl.common.megatron.step import price, work_from_microbatches

    ctx = int(context or max(sum(mb) for mb in micro_batches))
    model = MegatronModel.from_shape(shape, context=ctx)
    m = len(micro_batches)
    lay = MegatronLayout(dp=stack.dp, tp=stack.tp, pp=stack.pp, mbs=1, gbs=stack.dp * m, context=ctx, mode="pack",
                         recompute="full" if stack.recompute == "full" else "none",
                         distributed_optimizer=stack.distributed_optimizer)
    work = work_from_microbatches([[list(mb) for mb in micro_batches] for _ in range(stack.dp)])
    return float(price(model, lay, hw, work).max_peak_allocated_bytes)


@dataclass(frozen=True)
class Rank0Case:
    """One rank-0 configuration a system asks for (HotSPa: one per strategy group)."""

    label: str
    stack: RankStack
    micro_batches: tuple  # per micro-batch, the packed document lengths


def run_cases(shape, cases: Sequence[Rank0Case], kind: str, hw, *, steps: int = 2, lr: float = 1e-4,
              lora_alpha: float = 16.0, stack_note: str = ""):
    """Every case estimated (or run) and priced by the step model; the record's metrics come from
    the case with the largest tracked peak: ``peak_memory_bytes``, ``predicted_peak_memory_bytes``
    and their ratio (``peak_over_predicted``); ``rank0`` runs add ``step_time_s``."""
    from impl.common.api import Metric, RunResult

    rows, emulated = [], []
    for c in cases:
        r = run_rank0(shape, c.stack, c.micro_batches, Rank0Kind(kind), steps=steps, lr=lr, lora_alpha=lora_alpha)
        pred = predicted_peak_bytes(shape, c.stack, c.micro_batches, hw)
        emulated += [e for e in r.emulated if e not in emulated]
        rows.append({"case": c.label, "stack": {**c.stack.__dict__}, "micro_batches": [list(mb) for mb in c.micro_batches],
                     "peak_memory_bytes": r.peak_memory_bytes, "predicted_peak_memory_bytes": pred,
                     "peak_over_predicted": r.peak_memory_bytes / pred if pred > 0 else None,
                     "peak_by_kind": r.peak_by_kind, "peak_by_module": r.peak_by_module, "step_s": r.step_s,
                     "world": r.world})
    top = max(rows, key=lambda x: x["peak_memory_bytes"])
    m = {"peak_memory_bytes": Metric.scalar(float(top["peak_memory_bytes"]), "bytes", "lower"),
         "predicted_peak_memory_bytes": Metric.scalar(float(top["predicted_peak_memory_bytes"]), "bytes", "lower")}
    if top["peak_over_predicted"] is not None:
        m["peak_over_predicted"] = Metric.scalar(float(top["peak_over_predicted"]), "x", "lower")
    if kind == Rank0Kind.RANK0 and len(top["step_s"]) > 1:  # the first step builds Adam's state: not timed
        m["step_time_s"] = Metric.from_samples(top["step_s"][1:], "s", "lower")
    info = {"ranks": kind, "peak_case": top["case"], "cases": rows, "steps": steps,
            "predicted_by": "impl.common.megatron.step.price (stage 0 of the same static launch, same micro-batches)"}
    if stack_note:
        info["stack_note"] = stack_note
    return RunResult(metrics=m, emulated=emulated, info=info)
