"""fuse_wgrad_accumulation's bookkeeping (fp8/wgrad.py): where it runs, and that a weight whose
gradient TE sums into ``main_grad`` gets the same ``.grad`` as a plain layer, across gradient
accumulation, ``zero_grad`` in both forms and the optimizer step. TE itself cannot run on a CPU:
``TELikeLinear`` follows te.Linear's contract for it (transformer_engine/pytorch/module/linear.py:
the weight-gradient GEMM adds into ``weight.main_grad`` and hands autograd None); the real TE
layers run it in tests/test_gpu_any_model.py."""

import copy

import pytest
import torch
from torch import nn

from fp8_lightning.fp8.wgrad import FusedWgrad, fused_wgrad_blocker


class _Gemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, fuse):
        ctx.save_for_backward(x, weight)
        ctx.fuse = fuse  # TE reads the flag at the forward, main_grad at the backward
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        wgrad = grad.flatten(0, -2).t() @ x.flatten(0, -2)
        if ctx.fuse:
            weight.main_grad.add_(wgrad.float())
            wgrad = None
        return grad @ weight, wgrad, None


class TELikeLinear(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n) / n**0.5)
        self.fuse_wgrad_accumulation = False

    def forward(self, x):
        return _Gemm.apply(x, self.weight, self.fuse_wgrad_accumulation)


def pair():
    torch.manual_seed(0)
    plain = nn.Sequential(TELikeLinear(8), nn.GELU(), TELikeLinear(8))
    fused = copy.deepcopy(plain)
    return plain, fused, FusedWgrad([fused[0], fused[2]])


def backward(model, wgrad, x, extra=lambda model, x: 0.0):
    """A forward and backward as the plugin's hooks frame them (its training forward, then
    Lightning's zero_grad may come, then pre_backward)."""
    if wgrad is not None:
        wgrad.before_forward()
    loss = model(x).square().mean() + extra(model, x)
    if wgrad is not None:
        wgrad.before_backward()
    loss.backward()


def test_the_weights_get_the_gradients_a_plain_layer_gets_step_after_step():
    plain, fused, wgrad = pair()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, fused)]
    for step in range(3):
        for micro in range(2):  # gradient accumulation: the sum of both micro-batches
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + micro))
            backward(plain, None, x)
            backward(fused, wgrad, x)
        for p, q in zip(plain.parameters(), fused.parameters()):
            assert q.grad is q.main_grad and torch.allclose(p.grad, q.grad, atol=1e-6)
        nn.utils.clip_grad_norm_(fused.parameters(), 0.1)  # clipping sees (and scales) the sum
        nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=step != 1)  # both forms of zero_grad
    for p, q in zip(plain.parameters(), fused.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_a_weight_also_used_outside_its_te_layer_gets_both_parts():
    """A tied weight: TE sums its layer's part in main_grad, autograd adds the other use's
    into .grad, which is main_grad; after zero_grad(set_to_none) too."""
    plain, fused, wgrad = pair()
    tied = lambda model, x: (x @ model[0].weight).sum()  # noqa: E731 - the weight's other use
    for step in range(2):
        for model in (plain, fused):
            model.zero_grad(set_to_none=True)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        backward(plain, None, x, tied)
        backward(fused, wgrad, x, tied)
        assert torch.allclose(plain[0].weight.grad, fused[0].weight.grad, atol=1e-6)


def test_removed_the_layers_hand_autograd_their_gradient_again():
    plain, fused, wgrad = pair()
    backward(fused, wgrad, torch.randn(4, 8))
    linked = fused[0].weight.grad
    wgrad.remove()
    assert not fused[0].fuse_wgrad_accumulation and not hasattr(fused[0].weight, "main_grad")
    assert fused[0].weight.grad is linked  # what was summed stays the gradient
    fused.zero_grad()
    backward(fused, None, torch.randn(4, 8))
    assert fused[0].weight.grad is not None


@pytest.mark.parametrize("weights, group, params, expected", [
    ("bf16-mixed", False, [nn.Parameter(torch.zeros(2))], None),
    ("bf16-true", False, [nn.Parameter(torch.zeros(2))], "weights=bf16-true: .grad must be"),
    ("bf16-mixed", True, [nn.Parameter(torch.zeros(2))], "a process group (DDP, FSDP2)"),
    ("bf16-mixed", False, [], "no swapped TE layer with an FP32 weight"),
])
def test_it_runs_without_a_process_group_with_fp32_master_weights(weights, group, params,
                                                                  expected):
    why = fused_wgrad_blocker(weights, group, params)
    assert why == expected if expected is None else why.startswith(expected)
