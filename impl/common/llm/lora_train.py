"""Multi-task LoRA *training* on one frozen base (LobRA, arXiv 2509.01193, as its authors' code runs it:
Hetu `examples/lobra`, `python/hetu/peft/lora`; the serving kernels are in
:mod:`impl.common.llm.lora` and :mod:`impl.common.llm.kernels`).

One ``LlamaForCausalLM`` built from ``transformers.LlamaConfig`` (:func:`impl.common.llm.model.
build_llama`) carries one ``peft`` LoRA adapter per task (``LoraConfig(r, lora_alpha,
target_modules=q,k,v,o,gate,up,down)``, added with ``add_adapter``). The base is frozen (no
``requires_grad``); Adam holds only the adapter parameters.

A micro-batch is ``mbs`` sequences, each right-padded to the micro-batch's bucket length
``pad_len`` (LobRA pads to its bucket; HF attention masks the padding through the 2-D
``attention_mask``, positions run 0..s-1 per row, so a sequence computes what it computes
alone). Two execution modes, the knob ``mode``:
- ``"fused"``: a micro-batch may mix tasks. Every LoRA layer computes ``y = W x`` for all rows,
  then for each task t present ``y[rows_t] += B_t A_t x[rows_t] · alpha/r`` (``index_add``);
  ``rows_t`` are the flattened token rows of task t's sequences. The adapters'
  weights are peft's own modules, so this path is checked against the next one.
- ``"single"``: every micro-batch holds one task; ``set_adapter(task)`` then peft's stock
  forward. ``.grad`` of the other adapters persists across micro-batches.
Loss of a micro-batch = Σ_t Σ_{task-t target tokens} CE / G_t, with ``G_t`` the caller's count
of task t's target tokens in the whole step (every micro-batch of every replica), so summing
micro-batch gradients (and all-reducing them over replicas) gives Σ_t mean-CE_t however the
step was dispatched.

``checkpoint=True`` turns on HF gradient checkpointing (non-reentrant): the CPU stand-in for a
replica with a larger memory footprint (R_L of LobRA's real mode, impl/lobra/README.md).
"""
from __future__ import annotations

import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

from impl.common.api import ConfigError
from impl.common.workloads.pipeline import ModelShape

TRAIN_SITES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODES = ("fused", "single")
IGNORE = -100


@dataclass(frozen=True)
class Sample:
    """One training sequence: its task, a stream id unique within the task, its length
    (``length`` target tokens; the token row has ``length + 1`` tokens)."""

    task: str
    seq_id: int
    length: int


def sample_tokens(sample: Sample, vocab: int, seed: int) -> torch.Tensor:
    """Deterministic tokens of a sample (any rank regenerates them from (seed, task, id))."""
    g = torch.Generator().manual_seed(hash_key(seed, sample.task, sample.seq_id))
    return torch.randint(4, vocab, (int(sample.length) + 1,), generator=g)


def hash_key(seed: int, task: str, seq_id: int) -> int:
    # Python's hash() of a str is salted per process; a fixed polynomial is not.
    h = 1469598103934665603
    for ch in f"{seed}/{task}/{seq_id}":
        h = ((h ^ ord(ch)) * 1099511628211) % (1 << 61)
    return h


def task_token_counts(samples: Iterable[Sample]) -> dict[str, int]:
    """G_t: target tokens per task over a whole step."""
    out: dict[str, int] = {}
    for s in samples:
        out[s.task] = out.get(s.task, 0) + int(s.length)
    return out


def micro_batch_tensors(samples: Sequence[Sample], pad_len: int, vocab: int,
                        seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids [n, pad_len], targets [n, pad_len], attention_mask [n, pad_len])``."""
    n = len(samples)
    ids = torch.zeros((n, pad_len), dtype=torch.long)
    tgt = torch.full((n, pad_len), IGNORE, dtype=torch.long)
    mask = torch.zeros((n, pad_len), dtype=torch.long)
    for i, s in enumerate(samples):
        if s.length > pad_len:
            raise ConfigError(f"micro-batch: sequence {s.task}/{s.seq_id} of {s.length} tokens > pad_len {pad_len}")
        tok = sample_tokens(s, vocab, seed)
        ids[i, :s.length] = tok[:-1]
        tgt[i, :s.length] = tok[1:]
        mask[i, :s.length] = 1
    return ids, tgt, mask


def _lora_layers(model):
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def _row_split_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    rows: Optional[Mapping[str, torch.Tensor]] = getattr(self, "_lobra_rows", None)
    if rows is None:  # single-task mode: peft's own forward with the active adapter
        return type(self).forward(self, x, *args, **kwargs)
    y = self.base_layer(x, *args, **kwargs)
    shape = y.shape
    x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, shape[-1])
    for name, idx in rows.items():
        A, B = self.lora_A[name], self.lora_B[name]
        # adapters may be fp32 over a bf16 base (peft's default): their input in their dtype
        delta = B(A(x2.index_select(0, idx).to(A.weight.dtype))) * self.scaling[name]
        y2 = y2.index_add(0, idx, delta.to(y2.dtype))
    return y2.view(shape)


class MultiTaskLoRA:
    """The frozen base, one adapter per task, Adam over the adapters (see the module doc)."""

    def __init__(self, shape: ModelShape, tasks: Sequence[str], *, rank: int = 16, alpha: float = 16.0,
                 seed: int = 0, lr: float = 1e-4, checkpoint: bool = False, init_b_zero: bool = True,
                 data_seed: int = 0, device=None, dtype: Optional[torch.dtype] = None) -> None:
        """``device`` None: the CPU (a build elsewhere draws other weights for the same seed, see
        :func:`impl.common.llm.model.build_llama`); ``dtype``: the frozen base's (peft keeps the
        adapters in fp32 over a bf16 base)."""
        from peft import LoraConfig, get_peft_model

        from impl.common.llm.model import build_llama

        if not tasks:
            raise ConfigError("workload.tasks: a multi-task LoRA job needs >= 1 task")
        if len(set(tasks)) != len(tasks):
            raise ConfigError(f"workload.tasks: task names repeat: {list(tasks)}")
        for t in tasks:
            if not t or not t.replace("_", "").isalnum():
                raise ConfigError(f"workload.tasks: task name {t!r} must be letters, digits and '_' (it names a module)")
        if rank < 1:
            raise ConfigError(f"workload.lora_rank: must be >= 1, got {rank}")
        self.tasks = list(tasks)
        self.vocab = shape.vocab
        self.data_seed = data_seed
        base = build_llama(shape, seed=seed, device=device, dtype=dtype)
        self.device = next(base.parameters()).device
        base.config._attn_implementation = "sdpa"
        # init_lora_weights=True is peft's default (B = 0: the first step's A-gradient is 0);
        # False draws B too, which the gradient-equality tests need to be non-trivial.
        cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(TRAIN_SITES), lora_dropout=0.0,
                         bias="none", init_lora_weights=bool(init_b_zero))
        with torch.random.fork_rng():
            torch.manual_seed(seed + 1)
            model = get_peft_model(base, cfg, adapter_name=self.tasks[0])
            for t in self.tasks[1:]:
                model.add_adapter(t, cfg)
        self.model = model
        self.checkpoint = False
        self.set_checkpoint(checkpoint)
        model.train()
        self.layers = _lora_layers(model)
        for m in self.layers:
            m.forward = types.MethodType(_row_split_forward, m)
        self._all_trainable()
        self.base_params = {n: p for n, p in model.named_parameters() if "lora_" not in n}
        for p in self.base_params.values():
            p.requires_grad_(False)
        self.adapter_params = {t: [p for n, p in model.named_parameters() if "lora_" in n and f".{t}." in n]
                               for t in self.tasks}
        self.opt = torch.optim.Adam([p for ps in self.adapter_params.values() for p in ps], lr=lr)

    def set_checkpoint(self, on: bool) -> None:
        """Activation checkpointing on/off (a replica's kind may change between steps)."""
        inner = self.model.base_model.model
        # transformers >= 4.5x renamed gradient_* to activation_checkpointing_* (same switch).
        kw = {"use_reentrant": False}
        if on and not self.checkpoint:
            if hasattr(inner, "activation_checkpointing_enable"):
                inner.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
            else:
                inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        elif not on and self.checkpoint:
            (getattr(inner, "activation_checkpointing_disable", None) or inner.gradient_checkpointing_disable)()
        self.checkpoint = bool(on)
        self.model.train()

    def _all_trainable(self) -> None:
        # peft's set_adapter freezes the inactive adapters; every adapter stays trainable here
        # (an adapter with no rows in a micro-batch simply gets no gradient from it).
        for n, p in self.model.named_parameters():
            if "lora_" in n:
                p.requires_grad_(True)

    @contextmanager
    def _rows(self, rows: Optional[Mapping[str, torch.Tensor]]):
        for m in self.layers:
            m._lobra_rows = rows
        try:
            yield
        finally:
            for m in self.layers:
                m._lobra_rows = None

    def micro_batch(self, samples: Sequence[Sample], pad_len: int, task_tokens: Mapping[str, int],
                    mode: str = "fused") -> dict[str, float]:
        """Forward + backward of one micro-batch; gradients accumulate. Returns each present
        task's loss contribution (Σ CE / G_t over its tokens here)."""
        if mode not in MODES:
            raise ConfigError(f"system.exec_mode: unknown {mode!r} (one of: {', '.join(MODES)})")
        if not samples:
            return {}
        present = list(dict.fromkeys(s.task for s in samples))
        for t in present:
            if t not in self.adapter_params:
                raise ConfigError(f"micro-batch: task {t!r} has no adapter (have: {', '.join(self.tasks)})")
            if task_tokens.get(t, 0) < 1:
                raise ConfigError(f"task_tokens: task {t!r} has {task_tokens.get(t, 0)} global tokens")
        if mode == "single" and len(present) > 1:
            raise ConfigError(f"micro-batch: single-task mode got tasks {present} in one micro-batch")
        ids, tgt, mask = (t.to(self.device, non_blocking=True)
                          for t in micro_batch_tensors(samples, pad_len, self.vocab, self.data_seed))
        row_task = [s.task for s in samples]
        if mode == "fused":
            rows = {}
            for t in present:
                seq = torch.tensor([i for i, x in enumerate(row_task) if x == t], dtype=torch.long, device=self.device)
                rows[t] = (seq[:, None] * pad_len + torch.arange(pad_len, device=self.device)[None, :]).reshape(-1)
            ctx = self._rows(rows)
        else:
            self.model.set_adapter(present[0])
            self._all_trainable()
            ctx = self._rows(None)
        with ctx:
            logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                                 ignore_index=IGNORE, reduction="none").view(tgt.shape)
            weights = torch.tensor([1.0 / task_tokens[t] for t in row_task], dtype=ce.dtype, device=self.device)
            per_row = ce.sum(dim=1)
            loss = (per_row * weights).sum()
            loss.backward()
        # one device-to-host read per micro-batch (the caller times micro-batches by the clock)
        parts = (per_row.detach().double() * weights.double()).tolist()
        out: dict[str, float] = {}
        for i, t in enumerate(row_task):
            out[t] = out.get(t, 0.0) + parts[i]
        return out

    # ---- gradients and the update ------------------------------------------------------------
    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def adapter_grads(self) -> dict[str, torch.Tensor]:
        """Per task, every adapter parameter's gradient flattened (zeros where none)."""
        return {t: torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])
                for t, ps in self.adapter_params.items()}

    def has_grad(self, task: str) -> bool:
        return any(p.grad is not None and bool(p.grad.ne(0).any()) for p in self.adapter_params[task])

    def all_reduce_grads(self, group=None, tasks: Optional[Sequence[str]] = None) -> None:
        """Sum the adapter gradients of ``tasks`` (default: all) over the replicas (one flat
        buffer; each adapter is global to its job [R], impl/lobra/README.md). Adapters outside ``tasks``
        keep their (``None``) gradients, so Adam leaves them alone."""
        import torch.distributed as dist

        ps = [p for t in (self.tasks if tasks is None else tasks) for p in self.adapter_params[t]]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])
        dist.all_reduce(flat, group=group)
        off = 0
        for p in ps:
            n = p.numel()
            p.grad = flat[off:off + n].view_as(p).clone()
            off += n

    def step(self) -> None:
        self.opt.step()

    def adapter_state(self) -> dict[str, torch.Tensor]:
        return {t: torch.cat([p.detach().reshape(-1) for p in ps]) for t, ps in self.adapter_params.items()}

    def base_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.base_params.items()}
