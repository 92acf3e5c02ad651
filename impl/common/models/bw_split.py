"""B/W split of a Linear layer (ZeroBubble's "B" and "W").

A :class:`SplitLinear` computes ``y = x W^T + b`` like ``nn.Linear``. Its backward depends on
whether a :class:`WeightGradStash` was active when the *forward* ran:

* no stash (plain training, the single-process reference): backward returns the input
  gradient and the weight/bias gradients at once (a full backward, "BW");
* with a stash: backward returns only the input gradient ("B") and records ``(x, grad_out)``
  in the stash; :meth:`WeightGradStash.compute` later turns the records into
  ``grad_W = grad_out^T x`` and ``grad_b = sum(grad_out)`` ("W").

Both paths compute the weight gradient with the same function (:func:`linear_weight_grads`),
so a B-then-W gradient is bitwise the full-backward gradient. The stash is bound at forward
time (one stash per micro-batch), not looked up at backward time, because on CUDA the
autograd engine runs backward on its own device thread.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVE_STASH: contextvars.ContextVar[Optional["WeightGradStash"]] = contextvars.ContextVar(
    "active_weight_grad_stash", default=None)


def linear_weight_grads(x: torch.Tensor, grad_out: torch.Tensor, has_bias: bool):
    """Weight (and bias) gradient of ``y = x W^T + b``: the one formula both paths use."""
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    grad_w = g2.t().mm(x2)
    grad_b = g2.sum(0) if has_bias else None
    return grad_w, grad_b


class WeightGradStash:
    """The deferred weight-gradient work of one micro-batch on one stage."""

    def __init__(self) -> None:
        self._entries: list[tuple["SplitLinear", torch.Tensor, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, layer: "SplitLinear", x: torch.Tensor, grad_out: torch.Tensor) -> None:
        self._entries.append((layer, x, grad_out))

    def compute(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Run W: return ``[(param, grad), ...]`` and drop the saved tensors."""
        out: list[tuple[nn.Parameter, torch.Tensor]] = []
        for layer, x, grad_out in self._entries:
            gw, gb = linear_weight_grads(x, grad_out, layer.bias is not None)
            out.append((layer.weight, gw))
            if gb is not None:
                out.append((layer.bias, gb))
        self._entries.clear()
        return out

    def apply(self) -> None:
        """Run W and accumulate straight into ``.grad`` (in the order the records arrived)."""
        for param, grad in self.compute():
            accumulate_grad(param, grad)


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    # Same arithmetic as autograd's AccumulateGrad: first assignment, then in-place add.
    if param.grad is None:
        param.grad = grad.detach().clone()
    else:
        param.grad.add_(grad)


@contextlib.contextmanager
def defer_weight_grads(stash: WeightGradStash) -> Iterator[WeightGradStash]:
    """Forwards run inside this block defer their Linear weight gradients to ``stash``."""
    token = _ACTIVE_STASH.set(stash)
    try:
        yield stash
    finally:
        _ACTIVE_STASH.reset(token)


class _SplitLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer, stash):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.layer = layer
        ctx.stash = stash
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        if ctx.stash is None:
            grad_w, grad_b = linear_weight_grads(x, grad_out, ctx.has_bias)
            return grad_x, grad_w, grad_b, None, None
        ctx.stash.record(ctx.layer, x, grad_out)
        return grad_x, None, None, None, None


class SplitLinear(nn.Module):
    """``nn.Linear`` whose weight gradient can be deferred to a later W step."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.reset_parameters()

    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        # nn.Linear's default init, drawn from an explicit generator when one is given.
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            self.weight.uniform_(-bound, bound, generator=generator)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stash = _ACTIVE_STASH.get() if torch.is_grad_enabled() else None
        return _SplitLinearFn.apply(x, self.weight, self.bias, self, stash)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def split_linear_params(module: nn.Module) -> set[int]:
    """ids of the parameters whose gradient W (not B) produces."""
    ids: set[int] = set()
    for m in module.modules():
        if isinstance(m, SplitLinear):
            ids.add(id(m.weight))
            if m.bias is not None:
                ids.add(id(m.bias))
    return ids
