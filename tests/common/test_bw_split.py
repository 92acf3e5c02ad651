"""B/W split: deferred weight gradients equal a full backward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from impl.common.models.bw_split import SplitLinear, WeightGradStash, defer_weight_grads

torch.set_num_threads(1)


def _layer_and_input(seed=0, bias=True):
    torch.manual_seed(seed)
    layer = SplitLinear(8, 5, bias=bias)
    x = torch.randn(2, 3, 8, requires_grad=True)
    return layer, x


@pytest.mark.parametrize("bias", [True, False])
def test_b_then_w_equals_full_backward_bitwise(bias):
    layer, x = _layer_and_input(bias=bias)
    g = torch.randn(2, 3, 5)

    (layer(x) * g).sum().backward()
    full = [x.grad.clone(), layer.weight.grad.clone()] + ([layer.bias.grad.clone()] if bias else [])
    x.grad = None
    layer.zero_grad(set_to_none=True)

    stash = WeightGradStash()
    with defer_weight_grads(stash):
        y = layer(x)
    (y * g).sum().backward()
    assert layer.weight.grad is None, "B must not produce weight gradients"
    assert len(stash) == 1
    stash.apply()  # W
    split = [x.grad, layer.weight.grad] + ([layer.bias.grad] if bias else [])
    for a, b in zip(full, split):
        assert torch.equal(a, b)


def test_matches_torch_linear_autograd():
    layer, x = _layer_and_input()
    g = torch.randn(2, 3, 5)
    stash = WeightGradStash()
    with defer_weight_grads(stash):
        y = layer(x)
    gx, = torch.autograd.grad(y, x, g)
    grads = dict((id(p), t) for p, t in stash.compute())

    w = layer.weight.detach().clone().requires_grad_(True)
    b = layer.bias.detach().clone().requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    ref = F.linear(x2, w, b)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    ref.backward(g)
    torch.testing.assert_close(gx, x2.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads[id(layer.weight)], w.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads[id(layer.bias)], b.grad, rtol=1e-6, atol=1e-7)


def test_accumulation_in_microbatch_order_is_bitwise():
    layer, _ = _layer_and_input()
    xs = [torch.randn(2, 3, 8) for _ in range(4)]
    gs = [torch.randn(2, 3, 5) for _ in range(4)]
    for x, g in zip(xs, gs):  # full backward per micro-batch
        (layer(x) * g).sum().backward()
    full = layer.weight.grad.clone()
    layer.zero_grad(set_to_none=True)

    stashes = []
    for x, g in zip(xs, gs):  # all B first (ZB-style), then W in micro-batch order
        s = WeightGradStash()
        with defer_weight_grads(s):
            y = layer(x)
        (y * g).sum().backward()
        stashes.append(s)
    for s in stashes:
        s.apply()
    assert torch.equal(full, layer.weight.grad)


def test_no_stash_outside_grad_mode():
    layer, x = _layer_and_input()
    stash = WeightGradStash()
    with torch.no_grad(), defer_weight_grads(stash):
        layer(x)
    assert len(stash) == 0
