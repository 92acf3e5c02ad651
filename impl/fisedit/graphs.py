"""CUDA-graph capture of a steady-state UNet call (``system.cuda_graph: auto|off``).

:class:`GraphedUNet` patches ``unet.forward`` (so the FISEdit loop, the dense-edit loop and
a stock diffusers ``StableDiffusionPipeline`` all go through it) with a version that copies the
call's tensors (sample, timestep, text states) into static buffers and replays a graph captured
for the current regime. The regime key comes from the caller (``key_fn``): ``None`` runs the
call eagerly. One graph is kept per regime class (e.g. ``"dense"``, ``"sparse"``); a new key of
the same class recaptures (a new edit: new mask plans, new buffers) and frees the old graph.

Capture follows the PyTorch recipe (``torch.cuda.graphs``): warm-up iterations on a side stream
(they allocate the engine's persistent buffers and the cross-attention K/V), then capture with
``torch.cuda.graph``; the graph's output tensor is reused by every replay, so a caller must
consume it before the next call (the denoising loops do: eps = u + g (c - u) makes new tensors).
Nothing in a captured step may read a tensor back to the host: the fast engine's step index is
a device tensor written before each replay (``EngineState.set_step_index``).

Neither FISEdit's Hetu engine nor SIGE captures graphs; DistriFusion and stable-fast do.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

WARMUP = 1  # eager iterations on the side stream before capture (allocates buffers, K/V)


class _Graph:
    def __init__(self, key, fn, inputs, keep=None):
        self.key = key
        self.text = inputs[2]  # held: the graph is valid for this text states object only
        self.static_in = [x.clone() for x in inputs]
        self.text_version = inputs[2]._version
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                fn(*self.static_in)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_out = fn(*self.static_in)
        self.keep = keep() if keep else None  # buffers the graph reads, allocated outside it

    def __call__(self, inputs):
        for s, x in zip(self.static_in, inputs):
            s.copy_(x, non_blocking=True)
        self.graph.replay()
        return self.static_out


class GraphedUNet:
    """Context manager: while active, ``unet(sample, t, encoder_hidden_states=...)`` replays a
    CUDA graph for ``key_fn()`` (a (class, key) pair, or None = eager)."""

    def __init__(self, unet, key_fn: Callable[[], Optional[tuple]], keep: Optional[Callable] = None):
        self.unet = unet
        self.keep = keep
        self.key_fn = key_fn
        self.graphs: dict = {}
        self.captures = 0
        self.replays = 0
        self.eager_calls = 0

    def _forward(self, sample, timestep, encoder_hidden_states=None, *args, return_dict: bool = True, **kw):
        orig = type(self.unet).forward
        extra = any(v is not None for v in kw.values()) or args
        rk = None if extra else self.key_fn()
        if rk is None or sample.device.type != "cuda":
            self.eager_calls += 1
            return orig(self.unet, sample, timestep, encoder_hidden_states, *args, return_dict=return_dict, **kw)
        cls, key = rk
        if not torch.is_tensor(timestep):
            timestep = torch.tensor(timestep, device=sample.device)
        t = timestep.to(sample.device).reshape(())
        key = (key, tuple(sample.shape), sample.dtype, tuple(encoder_hidden_states.shape), t.dtype)
        g = self.graphs.get(cls)
        if g is None or g.key != key or (cls == "sparse" and (
                g.text is not encoder_hidden_states or g.text_version != encoder_hidden_states._version)):
            self.graphs.pop(cls, None)
            del g
            self.graphs[cls] = g = _Graph(key, lambda s, tt, e: orig(self.unet, s, tt, e, return_dict=False)[0],
                                          (sample, t, encoder_hidden_states), self.keep)
            self.captures += 1
        out = g((sample, t, encoder_hidden_states))
        self.replays += 1
        if return_dict:
            from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

            return UNet2DConditionOutput(sample=out)
        return (out,)

    @contextlib.contextmanager
    def active(self):
        self.unet.forward = self._forward
        try:
            yield self
        finally:
            del self.unet.forward

    def drop(self) -> None:
        """Forget every captured graph (the module tree changed: wrappers installed or removed)."""
        self.graphs.clear()

    def stats(self) -> dict:
        return {"captures": self.captures, "replays": self.replays, "eager_calls": self.eager_calls}


def resolve_cuda_graph(knob: str, device: torch.device) -> bool:
    """auto: capture on CUDA, eager elsewhere; off: eager."""
    return knob == "auto" and torch.device(device).type == "cuda"
