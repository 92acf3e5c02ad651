"""Real mode's ``max_tokens`` per replica kind by the authors' profiling rule (Hetu
``examples/lobra/scripts/profile_memory.py``) on a per-rank memory budget.

The rule: run mbs 1 with 2·pp micro-batches (pp = 1 here: 2) at each profile length; a kind's
max_tokens is the largest length whose peak fits the budget. On CPU there is no allocator peak to
read (``torch.cuda.max_memory_allocated`` is CUDA-only), so the peak of one micro-batch is
measured from the tensors autograd keeps for backward
(:func:`torch.autograd.graph.saved_tensors_hooks`, each storage counted once, parameters
excluded), which is what grows with the tokens:

- states: frozen fp32 base (4 B per parameter) + per adapter parameter fp32 value, gradient and
  Adam m, v (16 B); gradients of the two micro-batches accumulate in the same buffers;
- ``R_S`` (no checkpointing): everything the forward + loss saves;
- ``R_L`` (activation checkpointing, non-reentrant): what is saved outside the checkpointed
  layers (embedding, final norm, LM head, loss), each layer's input hidden state that the
  checkpoint keeps (mbs·s·h·4 B per layer), and one layer's working set while it is recomputed
  (the no-checkpoint saves of one layer: (R_S saves − R_L saves) / layers).

At pp = 1 a micro-batch's activations are freed by its backward before the next forward, so
the rule's second micro-batch cannot raise the peak: one is measured per length. Deterministic
(model seeded, byte counts, not timings).
"""
from __future__ import annotations

from dataclasses import dataclass
import torch

from impl.common.api import ConfigError
from impl.common.llm.lora_train import MultiTaskLoRA, Sample

PROFILE_ID0 = 1 << 41
FP32 = 4


@dataclass(frozen=True)
class KindMemory:
    kind: str
    states_bytes: int
    peak_bytes: dict  # length -> states + activations of one micro-batch of that length


def _saved_bytes(model: MultiTaskLoRA, length: int) -> int:
    """Distinct storages autograd saves for one micro-batch's backward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.model.parameters()}
    task = model.tasks[0]
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.micro_batch([Sample(task, PROFILE_ID0 + length, length)], length, {task: length})
    model.zero_grad()
    return sum(seen.values())


_CACHE: dict = {}


def profile_memory(shape, num_tasks: int, rank: int, lengths: tuple[int, ...], seed: int = 0) -> dict:
    """``{kind: KindMemory}`` for the real tiny model (see the module doc); cached per input."""
    key = (repr(shape), num_tasks, rank, tuple(lengths), seed)
    if key not in _CACHE:
        _CACHE[key] = _profile(shape, num_tasks, rank, tuple(lengths), seed)
    return _CACHE[key]


def _profile(shape, num_tasks: int, rank: int, lengths: tuple[int, ...], seed: int) -> dict:
    torch.manual_seed(seed)
    names = [f"t{i}" for i in range(num_tasks)]
    model = MultiTaskLoRA(shape, names, rank=rank, seed=seed)
    base = sum(p.numel() for p in model.base_params.values())
    lora = sum(p.numel() for ps in model.adapter_params.values() for p in ps)
    states = FP32 * base + 4 * FP32 * lora
    full, ckpt = {}, {}
    for s in lengths:
        model.set_checkpoint(False)
        full[s] = _saved_bytes(model, s)
        model.set_checkpoint(True)
        ckpt[s] = _saved_bytes(model, s)
    model.set_checkpoint(False)
    L, h = shape.num_layers, shape.hidden
    out = {"R_S": KindMemory("R_S", states, {s: states + full[s] for s in lengths}),
           "R_L": KindMemory("R_L", states, {s: states + ckpt[s] + L * s * h * FP32 + (full[s] - ckpt[s]) // L
                                             for s in lengths})}
    return out


def caps_from_budget(mem: dict, budget_bytes: float, field: str = "system.real.memory_budget_bytes") -> dict:
    """``{kind: max_tokens}``: the largest profiled length whose peak fits; one-line error when a
    kind fits none."""
    caps = {}
    for kind, km in mem.items():
        fit = [s for s, b in sorted(km.peak_bytes.items()) if b <= budget_bytes]
        if not fit:
            need = min(km.peak_bytes.values())
            raise ConfigError(f"{field}: {budget_bytes:.4g} B holds no profiled length on {kind} (the shortest needs "
                              f"{need:.4g} B)")
        caps[kind] = fit[-1]
    return caps
