"""FP32 weight gradients straight from TE's GEMM in a user's model (``fuse_wgrad_accumulation``).

A swapped ``te.Linear`` computes its weight gradient in BF16; autograd then converts it into the
FP32 parameter's ``.grad``, one conversion kernel per weight a step, and a block replayed as a CUDA
graph copies it out of the graph's static buffer as well (nanoGPT 1.3B on an H100: 339
conversions, 8.8 ms, and 339 copies, 5.8 ms, a step). With TE's ``fuse_wgrad_accumulation`` the
weight-gradient GEMM accumulates in FP32 into ``weight.main_grad`` and hands autograd nothing;
:class:`FusedWgrad` keeps that buffer as the weight's ``.grad``, which PyTorch's optimizers and
gradient clipping read (Megatron's DDP does the same with buffers of its own).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def fused_wgrad_blocker(weights: str, world_size: int, params: list[nn.Parameter]
                        ) -> Optional[str]:
    """Why the weight gradients cannot accumulate in ``main_grad`` here (None: they can)."""
    from torch.distributed.tensor import DTensor

    if weights != "bf16-mixed":
        return f"weights={weights}: .grad must be the FP32 master weight's dtype (bf16-mixed)"
    if world_size > 1:
        return ("several processes: DDP reduces the gradients autograd hands it, and a fused "
                "weight's goes to main_grad instead")
    if any(isinstance(p, DTensor) for p in params):
        return "FSDP2's sharded parameters"
    if not params:
        return "no TE module with a weight"
    return None


class FusedWgrad:
    """The TE modules' weights accumulate their gradient in FP32 ``main_grad``, which is their
    ``.grad``: allocated before a training forward, summed from zero after the optimizer or the
    user dropped ``.grad`` (``zero_grad``), linked after each backward. Every fused weight is
    treated as used in each backward (a weight a step skips gets a zero gradient, not None)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        self.weights = [module.weight for module in modules]
        for module in modules:
            module.fuse_wgrad_accumulation = True

    def before_forward(self) -> None:
        """A ``main_grad`` on each weight's device (allocated once; again after a move)."""
        for weight in self.weights:
            grad = getattr(weight, "main_grad", None)
            if grad is not None and grad.device == weight.device and grad.shape == weight.shape:
                continue
            kept = weight.grad  # a gradient summed so far (moved with the weight) stays the sum
            weight.main_grad = (kept if kept is not None and kept.dtype == torch.float32 and
                                kept.device == weight.device else
                                torch.zeros_like(weight, dtype=torch.float32))

    def before_backward(self) -> None:
        """A weight whose ``.grad`` was dropped since the last backward starts from zero."""
        fresh = [weight.main_grad for weight in self.weights
                 if weight.grad is None and getattr(weight, "main_grad", None) is not None]
        if fresh:
            torch._foreach_zero_(fresh)

    def after_backward(self) -> None:
        """Each weight's ``.grad`` is its ``main_grad``, where TE summed the gradient."""
        for weight in self.weights:
            grad = getattr(weight, "main_grad", None)
            if weight.grad is None and grad is not None and weight.requires_grad:
                weight.grad = grad

    def remove(self) -> None:
        """TE's own weight gradients again; a ``.grad`` linked so far stays as it is."""
        for module, weight in zip(self.modules, self.weights):
            module.fuse_wgrad_accumulation = False
            weight.__dict__.pop("main_grad", None)
