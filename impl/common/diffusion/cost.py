"""Per-op cost model of a diffusers UNet (roofline), traced on the meta device.

:func:`trace_unet_ops` builds the real ``UNet2DConditionModel`` on the ``meta`` device (no
memory, no weights) and runs one forward with hooks; every Conv2d, Linear, GroupNorm,
LayerNorm and attention core becomes an :class:`UNetOp` with its shapes, FLOPs and bytes.
:func:`op_time_s` is a roofline: ``max(flops / (peak[dtype] * mfu), bytes / mem_bw) + launch``,
with a k>1 convolution at the profile's measured conv rate where it has one (``conv_flops``:
oneDNN runs a 3x3 conv at ~2x the sgemm rate on this CPU), a 1x1 conv at the matmul rate,
the attention core at the measured attention rate where the profile has one (``attn_flops``),
and a linear at the measured token-linear rate where it has one (``linear_flops``).
:func:`stream_time_s` puts a sequence of kernels on one CUDA stream: the host issues each
launch in ``launch_s`` and the GPU runs the kernels back to back, so launch cost is exposed
only where kernels are shorter than their launches (CUDA kernel launches are asynchronous to
the host; CUDA C++ Programming Guide, "Asynchronous Concurrent Execution").
On a profile with ``host_dispatch_s`` (a CPU host, where Python issues every op on the core
that runs it) a step is also charged its torch calls at that cost, serially:
:func:`forward_torch_calls` counts the dense forward's calls (:class:`TorchCallCounter` on the
meta-device forward, the same code path the real run takes).
Elementwise work that is not a module (SiLU, residual adds) is charged to the norm ops as
``ELEMENTWISE_PASSES`` extra read+write passes over their tensors, unless the profile has glue
rates (``activation_bytes_per_s`` / ``elementwise_bytes_per_s``, measured by calibrate): then
:func:`trace_unet_glue` records every such call of the meta forward (:class:`GlueTracer`) and
:func:`glue_time_s` prices it, and the norms carry their own bytes only.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

from impl.common.hardware import HardwareProfile

BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2}
ELEMENTWISE_PASSES = 2  # activation + residual, charged to each norm op


@dataclass(frozen=True)
class UNetOp:
    name: str
    kind: str  # conv | linear | attn_core | groupnorm | layernorm
    cells: int  # spatial cells (H*W) or tokens of the output grid; 0 = not spatial (time emb, text)
    flops: float  # at batch `batch`
    bytes_in: float  # activation bytes read (elements; multiply by dtype size)
    bytes_out: float  # activation bytes written (elements)
    weight_elems: float
    block: str = ""  # transformer block the op belongs to ("" = none)
    role: str = ""  # attn1.q | attn1.kv | attn1.core | attn1.out | attn2.q | attn2.kv | attn2.core | ff | proj | ...
    kernel: int = 1
    stride: int = 1
    cin: int = 0
    cout: int = 0
    hw: tuple = ()


def _role(name: str) -> str:
    parts = name.split(".")
    for a in ("attn1", "attn2"):
        if a in parts:
            leaf = parts[parts.index(a) + 1] if parts.index(a) + 1 < len(parts) else ""
            if leaf in ("to_q",):
                return f"{a}.q"
            if leaf in ("to_k", "to_v"):
                return f"{a}.kv"
            if leaf == "to_out":
                return f"{a}.out"
            return f"{a}.core"
    if ".ff." in name:
        return "ff"
    if name.endswith(("proj_in", "proj_out")):
        return "proj"
    if ".norm1" in name and "transformer_blocks" in name or ".norm2" in name and "transformer_blocks" in name \
            or ".norm3" in name and "transformer_blocks" in name:
        return "ln"
    return ""


def _block_of(name: str) -> str:
    if "transformer_blocks." in name:
        head, _, tail = name.partition("transformer_blocks.")
        return head + "transformer_blocks." + tail.split(".")[0]
    return ""


@functools.lru_cache(maxsize=16)
def _trace(shape_key: tuple, latent: int, batch: int, text_len: int) -> tuple:
    from diffusers import UNet2DConditionModel
    from diffusers.models.attention_processor import Attention

    kw = dict(shape_key)
    with torch.device("meta"):
        unet = UNet2DConditionModel(**kw)
    ops: list[UNetOp] = []

    def hook(name, mod):
        def f(m, inputs, kwargs, output):
            x = inputs[0] if inputs else kwargs.get("hidden_states")
            if isinstance(m, torch.nn.Conv2d):
                B, Ci, H, W = x.shape
                _, Co, Ho, Wo = output.shape
                k = m.kernel_size[0]
                ops.append(UNetOp(name, "conv", Ho * Wo, 2.0 * B * Ci * Co * k * k * Ho * Wo, x.numel(), output.numel(),
                              m.weight.numel(), "", "conv", k, m.stride[0], Ci, Co, (Ho, Wo)))
            elif isinstance(m, torch.nn.Linear):
                tokens = x.numel() // x.shape[-1]
                cells = x.shape[1] if x.ndim == 3 else 0
                ops.append(UNetOp(name, "linear", cells, 2.0 * tokens * m.in_features * m.out_features, x.numel(),
                              output.numel(), m.weight.numel(), _block_of(name), _role(name),
                              cin=m.in_features, cout=m.out_features))
            elif isinstance(m, torch.nn.GroupNorm):
                cells = x.shape[-1] * x.shape[-2] if x.ndim == 4 else 0
                ops.append(UNetOp(name, "groupnorm", cells, 8.0 * x.numel(), x.numel() * (1 + ELEMENTWISE_PASSES),
                              output.numel() * (1 + ELEMENTWISE_PASSES), 0, "", "gn", cin=x.shape[1], cout=x.shape[1],
                              hw=tuple(x.shape[-2:]) if x.ndim == 4 else ()))
            elif isinstance(m, torch.nn.LayerNorm):
                ops.append(UNetOp(name, "layernorm", x.shape[1] if x.ndim == 3 else 0, 8.0 * x.numel(),
                              x.numel() * (1 + ELEMENTWISE_PASSES), output.numel() * (1 + ELEMENTWISE_PASSES), 0,
                              _block_of(name), "ln", cin=x.shape[-1], cout=x.shape[-1]))
            elif isinstance(m, Attention):
                q = x
                kv = inputs[1] if len(inputs) > 1 and inputs[1] is not None else kwargs.get("encoder_hidden_states")
                kv = q if kv is None else kv
                B, Nq, C = q.shape
                Nk = kv.shape[1]
                inner = m.inner_dim
                ops.append(UNetOp(name + ".core", "attn_core", Nq, 4.0 * B * Nq * Nk * inner,
                              B * (Nq + 2 * Nk) * inner, B * Nq * inner, 0, _block_of(name),
                              ("attn1" if name.endswith("attn1") else "attn2") + ".core", cin=inner, cout=inner))
        return f

    for name, mod in unet.named_modules():
        if isinstance(mod, (torch.nn.Conv2d, torch.nn.Linear, torch.nn.GroupNorm, torch.nn.LayerNorm)):
            mod.register_forward_hook(hook(name, mod), with_kwargs=True)
        elif isinstance(mod, Attention):
            mod.register_forward_hook(hook(name, mod), with_kwargs=True)
    with torch.no_grad():
        x = torch.zeros(batch, kw.get("in_channels", 4), latent, latent, device="meta")
        e = torch.zeros(batch, text_len, kw["cross_attention_dim"], device="meta")
        unet(x, torch.tensor(10, device="meta"), encoder_hidden_states=e)
    return tuple(ops)


# Tensor metadata queries that go through __torch_function__ but dispatch no op (sub-microsecond).
_NOT_DISPATCHED = frozenset({"__get__", "device", "numel", "dim", "size", "is_floating_point"})


class TorchCallCounter(TorchFunctionMode):
    """Counts the torch calls Python issues inside the ``with`` block (functions, tensor methods,
    indexing: every call that goes through the dispatcher; metadata queries not counted)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") not in _NOT_DISPATCHED:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _meta_unet(shape_key: tuple, latent: int, batch: int, text_len: int) -> tuple:
    """The UNet and one forward's inputs (latent, timestep, text states) on the meta device."""
    from diffusers import UNet2DConditionModel

    kw = dict(shape_key)
    with torch.device("meta"):
        unet = UNet2DConditionModel(**kw)
        x = torch.zeros(batch, kw.get("in_channels", 4), latent, latent)
        e = torch.zeros(batch, text_len, kw["cross_attention_dim"])
        t = torch.tensor(10)
    return unet, x, t, e


@functools.lru_cache(maxsize=16)
def _forward_calls(shape_key: tuple, latent: int, batch: int, text_len: int) -> int:
    unet, x, t, e = _meta_unet(shape_key, latent, batch, text_len)
    with torch.no_grad(), TorchCallCounter() as counter:
        unet(x, t, encoder_hidden_states=e)
    return counter.calls


# Non-module tensor work of a forward (``glue``): activations (transcendental, compute-bound on a
# CPU core) and the rest (residual adds, output-scale divisions, concatenations, upsampling and
# the copies of .contiguous() / reshape on a non-contiguous tensor). Views, dropout in eval and
# dtype no-ops move no bytes and are not glue.
GLUE_ACTIVATIONS = frozenset({"silu", "gelu"})
GLUE_ELEMENTWISE = frozenset({"add", "__add__", "__radd__", "__iadd__", "add_", "mul", "__mul__", "__rmul__",
                              "__imul__", "mul_", "div", "__truediv__", "__itruediv__", "div_", "sub", "__sub__",
                              "__rsub__", "cat", "interpolate"})
GLUE_COPIES = frozenset({"contiguous", "reshape"})  # glue only when they copy (a non-contiguous input)


class GlueTracer(TorchFunctionMode):
    """Records each glue call of the ``with`` block as an :class:`UNetOp` (kind ``activation`` or
    ``elementwise``; bytes = tensor inputs + output, in elements), with the transformer block of
    the innermost module running it (``module_stack``, kept by the trace's module hooks)."""

    def __init__(self):
        super().__init__()
        self.ops: list[UNetOp] = []
        self.module_stack: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        kind = ("activation" if name in GLUE_ACTIVATIONS else "elementwise" if name in GLUE_ELEMENTWISE
                or name in GLUE_COPIES and args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous()
                else "")
        if kind and isinstance(out, torch.Tensor):
            flat = [a for a in args if isinstance(a, torch.Tensor)]
            flat += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            where = self.module_stack[-1] if self.module_stack else ""
            cells = out.shape[-1] * out.shape[-2] if out.ndim == 4 else out.shape[1] if out.ndim == 3 else 0
            self.ops.append(UNetOp(f"{where}:{name}", kind, cells, 0.0, float(sum(t.numel() for t in flat)),
                               float(out.numel()), 0, _block_of(where), "glue"))
        return out


@functools.lru_cache(maxsize=16)
def _glue(shape_key: tuple, latent: int, batch: int, text_len: int) -> tuple:
    unet, x, t, e = _meta_unet(shape_key, latent, batch, text_len)
    tracer = GlueTracer()

    def enter(name):
        def hook(mod, args) -> None:
            tracer.module_stack.append(name)
        return hook

    def leave(mod, args, out) -> None:  # returning None keeps the module's output
        tracer.module_stack.pop()

    for name, mod in unet.named_modules():
        mod.register_forward_pre_hook(enter(name))
        mod.register_forward_hook(leave)
    with torch.no_grad(), tracer:
        unet(x, t, encoder_hidden_states=e)
    return tuple(tracer.ops)


def _shape_key(shape, attention_head_dim) -> tuple:
    kw = shape.kwargs()
    if attention_head_dim is not None:
        kw["attention_head_dim"] = tuple(attention_head_dim) if isinstance(attention_head_dim, list) else attention_head_dim
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kw.items()))


def forward_torch_calls(shape, latent: Optional[int] = None, batch: int = 2, text_len: int = 77,
                        attention_head_dim=None) -> int:
    """Torch calls of one dense UNet forward (:class:`TorchCallCounter`), for a :class:`UNetShape`,
    counted on the meta device (within ~1% of a CPU forward: a few ``.contiguous()`` calls
    differ with meta tensors' strides)."""
    return _forward_calls(_shape_key(shape, attention_head_dim), int(latent or shape.sample_size), batch, text_len)


def trace_unet_ops(shape, latent: Optional[int] = None, batch: int = 2, text_len: int = 77,
                   attention_head_dim=None) -> list[UNetOp]:
    """Ops of one UNet forward at ``batch`` (CFG = 2) for a :class:`UNetShape`."""
    return list(_trace(_shape_key(shape, attention_head_dim), int(latent or shape.sample_size), batch, text_len))


def trace_unet_glue(shape, latent: Optional[int] = None, batch: int = 2, text_len: int = 77,
                    attention_head_dim=None) -> list[UNetOp]:
    """Glue ops (:class:`GlueTracer`) of one UNet forward, traced on the meta device."""
    return list(_glue(_shape_key(shape, attention_head_dim), int(latent or shape.sample_size), batch, text_len))


def glue_time_s(op: UNetOp, hw: HardwareProfile, dtype: str, scale: float = 1.0) -> float:
    """A glue op's bytes (read + written) at the profile's measured rate for its kind; 0 on a
    profile without glue rates (the norm ops' ``ELEMENTWISE_PASSES`` stand for it there)."""
    bw = hw.glue_bw(op.kind, dtype)
    return (op.bytes_in + op.bytes_out) * BYTES[dtype] * scale / bw if bw else 0.0


def op_time_s(op: UNetOp, hw: HardwareProfile, dtype: str, *, flops_scale: float = 1.0, bytes_scale: float = 1.0,
              launch_s: float = 5e-6, windowed: bool = False) -> float:
    """Roofline time of ``op``; ``windowed``: a conv run on gathered windows (block-sparse),
    priced at :meth:`HardwareProfile.conv_window_flops_per_s`."""
    b = BYTES[dtype]
    if op.kind in ("groupnorm", "layernorm") and hw.glue_bw("elementwise", dtype):
        bytes_scale /= 1 + ELEMENTWISE_PASSES  # the glue is priced on its own (glue_time_s)
    mem = (op.bytes_in + op.bytes_out) * bytes_scale * b + op.weight_elems * b
    if op.kind == "conv" and windowed and op.kernel > 1:
        rate = hw.conv_window_flops_per_s(dtype)
    elif op.kind == "conv" and op.kernel > 1:
        rate = hw.conv_flops_per_s(dtype)
    elif op.kind == "attn_core":
        rate = hw.attn_flops_per_s(dtype)
    elif op.kind == "linear":
        rate = hw.linear_flops_per_s(dtype)
    else:
        rate = hw.flops(dtype)
    return max(op.flops * flops_scale / rate, mem / hw.memory_bw_bytes_per_s) + launch_s


def stream_time_s(kernels, launch_s: float) -> float:
    """Wall time of ``kernels`` = [(gpu_seconds, launches), ...] issued in order on one stream.

    The host issues launch j at ``j * launch_s``; a kernel group starts when its last launch is
    issued and the previous group has finished. Long kernels hide later launches (the host runs
    ahead), short ones expose them; the serial sum ``sum(gpu + launches * launch_s)`` is the
    synchronous upper bound, ``max(sum gpu, launches * launch_s)`` the lower one.
    """
    issued = end = 0.0
    for gpu_s, n in kernels:
        issued += n * launch_s
        end = max(end, issued) + gpu_s
    return end


def dense_step_time_s(ops, hw: HardwareProfile, dtype: str, launch_s: float = 5e-6, torch_calls: int = 0,
                      glue=()) -> float:
    """One UNet forward, one kernel per traced op, launches overlapped with execution; plus
    ``torch_calls`` (:func:`forward_torch_calls`) at the profile's ``host_dispatch_s``, and the
    ``glue`` ops (:func:`trace_unet_glue`) at its glue rates where it has them."""
    kernels = [(op_time_s(o, hw, dtype, launch_s=0.0), 1) for o in ops]
    kernels += [(glue_time_s(g, hw, dtype), 1) for g in glue if hw.glue_bw(g.kind, dtype)]
    return stream_time_s(kernels, launch_s) + torch_calls * hw.diffusion.host_dispatch_s
