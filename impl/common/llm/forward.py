"""Ragged (continuous-batching) forward of a HF Llama: many requests' new tokens flattened into
one [T, d] batch, each request with its own KV cache (vLLM-style), multi-LoRA deltas from a
:class:`~impl.common.llm.lora.LoRABatch` and an optional CPU path per (request, layer).

The projections use the HF modules' weights; LoRA sites are computed as ``base + delta`` with
one synchronisation point per distinct LoRA input (q/k/v share theirs; o has its own).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from impl.common.llm.kernels import lora_delta
from impl.common.llm.lora import LoRABatch

QKV = ("q_proj", "k_proj", "v_proj")
O = ("o_proj",)


@dataclass
class KVCache:
    """Per-request cache: per layer (k, v) with shape [kv_heads, T, head_dim]."""

    layers: list = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.layers else self.layers[0][0].shape[1]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer == len(self.layers):
            self.layers.append((k, v))
        else:
            pk, pv = self.layers[layer]
            self.layers[layer] = (torch.cat([pk, k], 1), torch.cat([pv, v], 1))
        return self.layers[layer]

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.layers)


@dataclass
class RequestSlice:
    """One request's slice of an iteration: its new tokens and its cache."""

    tokens: Sequence[int]
    cache: KVCache


class CPUPath:
    """Which (slot, layer) deltas come from the CPU, and how to get them.

    ``decide(slot, layer) -> bool`` is asked once per layer before the layer runs (CaraServe
    switches at a layer-group boundary as soon as the group is resident); ``submit(slot, layer,
    sites, x_rows) -> handle`` starts the CPU computation, ``handle.wait() -> [delta per site]``.
    ``x_rows`` are the device activations: the CPU side copies them to the host itself (a
    blocking D2H, issued before this layer's base GEMMs are launched, so the GPU runs them while
    the CPU computes the delta); the host deltas are added back with an H2D copy.
    """

    def __init__(self, decide: Callable[[int, int], bool], submit: Callable):
        self.decide = decide
        self.submit = submit


class InlineCPU:
    """The plain CPU path: each ``submit`` computes the deltas in this process, at once.

    Same interface as CaraServe's CPU LoRA worker process (:mod:`impl.caraserve.cpu_prefill`);
    the engine falls back to it when no worker is passed in (tests, ``cpu_workers: 0``). Like
    the worker it computes on the host in fp32 from the host adapters: ``x`` is copied to the
    host (from the device, or from another dtype), and the caller adds the fp32 deltas back
    where its activations are. On a CPU fp32 job every conversion is a no-op.
    """

    class _Done:
        def __init__(self, deltas):
            self.deltas = deltas

        def wait(self):
            return self.deltas

    def __init__(self, adapters: dict):
        self.adapters = adapters
        self.jobs = 0
        self.wait_s = 0.0

    def submit(self, adapter: str, layer: int, sites: Sequence[str], x: torch.Tensor):
        ad = self.adapters[adapter]
        self.jobs += 1
        xh = x.to("cpu", torch.float32)
        return self._Done([lora_delta(xh, ad.A[s][layer].float(), ad.B[s][layer].float(), ad.scale) for s in sites])

    def close(self):
        pass


@torch.no_grad()
def ragged_forward(model, items: Sequence[RequestSlice], batch: Optional[LoRABatch] = None,
                   cpu: Optional[CPUPath] = None, all_logits: bool = False,
                   layer_hook: Optional[Callable[[int], None]] = None) -> torch.Tensor:
    """Run the new tokens of ``items``; appends to their caches. Returns logits of each item's
    last token [n_items, V] (or of every token [T, V] with ``all_logits``)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    lm = model.model
    cfg = model.config
    H, KVH = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    dev = lm.embed_tokens.weight.device
    lens = [len(it.tokens) for it in items]
    starts = [it.cache.length for it in items]
    ids = torch.tensor([t for it in items for t in it.tokens], dtype=torch.long, device=dev)
    pos = torch.cat([torch.arange(s, s + n, device=dev) for s, n in zip(starts, lens)])
    h = lm.embed_tokens(ids)
    cos, sin = lm.rotary_emb(h.unsqueeze(0), pos.unsqueeze(0))
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    cpu_slots_per_item = [a for a, _ in batch.segments] if batch is not None else [-1] * len(items)
    if batch is not None:
        batch.cpu_layers = {}

    def project(layer_idx, sites, x, attn):
        handles = []
        if cpu is not None and batch is not None:
            for i, slot in enumerate(cpu_slots_per_item):
                if slot >= 0 and layer_idx in batch.cpu_layers.get(slot, ()):
                    a, b = offsets[i], offsets[i + 1]
                    handles.append((a, b, cpu.submit(slot, layer_idx, sites, x[a:b])))
        outs = [getattr(attn, s)(x) for s in sites]
        if batch is not None:
            for s, y in zip(sites, outs):
                batch.apply(layer_idx, s, x, y)
        for a, b, hnd in handles:
            for y, d in zip(outs, hnd.wait()):
                # the host delta back to where y is (H2D on CUDA; nothing on a CPU fp32 job)
                y[a:b] += d.to(y.device, y.dtype, non_blocking=True)
        return outs

    for l, layer in enumerate(lm.layers):
        if layer_hook is not None:
            layer_hook(l)
        if cpu is not None and batch is not None:
            for slot in set(cpu_slots_per_item):
                if slot >= 0 and cpu.decide(slot, l):
                    batch.cpu_layers.setdefault(slot, set()).add(l)
        attn = layer.self_attn
        res = h
        x = layer.input_layernorm(h)
        q, k, v = project(l, QKV, x, attn)
        T = x.shape[0]
        q = q.view(T, H, hd).transpose(0, 1).unsqueeze(0)
        k = k.view(T, KVH, hd).transpose(0, 1).unsqueeze(0)
        v = v.view(T, KVH, hd).transpose(0, 1).unsqueeze(0)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        outs = []
        for i, it in enumerate(items):
            a, b = offsets[i], offsets[i + 1]
            kf, vf = it.cache.append(l, k[0, :, a:b], v[0, :, a:b])
            qi = q[:, :, a:b]
            ki = repeat_kv(kf.unsqueeze(0), H // KVH)
            vi = repeat_kv(vf.unsqueeze(0), H // KVH)
            n, s0 = b - a, starts[i]
            # eager attention (as HF's eager path): fp32 softmax over causal scores
            scores = torch.matmul(qi, ki.transpose(2, 3)) * (hd ** -0.5)
            if n > 1:
                qpos = torch.arange(s0, s0 + n, device=dev).unsqueeze(1)
                kpos = torch.arange(kf.shape[1], device=dev).unsqueeze(0)
                scores = scores.masked_fill(kpos > qpos, torch.finfo(scores.dtype).min)
            w = F.softmax(scores, dim=-1, dtype=torch.float32).to(qi.dtype)
            outs.append(torch.matmul(w, vi)[0].transpose(0, 1).reshape(n, H * hd))
        attn_out = torch.cat(outs, 0)
        (o,) = project(l, O, attn_out, attn)
        h = res + o
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = lm.norm(h)
    if all_logits:
        return model.lm_head(h)
    last = torch.tensor([o - 1 for o in offsets[1:]], device=dev)
    return model.lm_head(h[last])
