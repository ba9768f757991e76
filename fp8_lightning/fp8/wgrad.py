"""FP32 weight gradients straight from TE's GEMM in a user's model (``fuse_wgrad_accumulation``).

A swapped ``te.Linear`` computes its weight gradient in BF16; autograd then converts it into the
FP32 parameter's ``.grad``, one conversion kernel per weight a step, and a block replayed as a CUDA
graph copies it out of the graph's static buffer as well (measured: docs/benchmarks.md, "Your
own model under FP8Precision"). With TE's ``fuse_wgrad_accumulation`` the
weight-gradient GEMM accumulates in FP32 into ``weight.main_grad`` and hands autograd nothing;
:class:`FusedWgrad` keeps that buffer as the weight's ``.grad``, which PyTorch's optimizers and
gradient clipping read (Megatron's DDP does the same with buffers of its own).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .policy import gemm_weights


def weight_params(module: nn.Module) -> list[nn.Parameter]:
    """A swapped TE layer's GEMM weights: ``weight`` (``te.Linear``, ``te.LayerNormLinear``) or
    ``fc1_weight`` and ``fc2_weight`` (``te.LayerNormMLP``)."""
    return [getattr(module, name) for name in gemm_weights(module)]


def fused_wgrad_blocker(weights: str, process_group: bool, params: list[nn.Parameter]
                        ) -> Optional[str]:
    """Why the weight gradients cannot accumulate in ``main_grad`` here (None: they can)."""
    from torch.distributed.tensor import DTensor

    if weights != "bf16-mixed":
        return f"weights={weights}: .grad must be the FP32 master weight's dtype (bf16-mixed)"
    if process_group:
        return ("a process group (DDP, FSDP2): their hooks take the gradients autograd hands "
                "them, and a fused weight's goes to main_grad instead")
    if any(isinstance(p, DTensor) for p in params):
        return "FSDP2's sharded parameters"
    if not params:
        return "no swapped TE layer with an FP32 weight"
    return None


class FusedWgrad:
    """The swapped TE layers' weights accumulate their gradient in FP32 ``main_grad``, which is
    their ``.grad`` from before each forward and backward on: summed from zero after the
    optimizer or the user dropped ``.grad`` (``zero_grad``), and taking in a gradient autograd
    put there meanwhile (a weight also used outside its TE layer, e.g. tied). Every fused weight
    is treated as used in each backward (a weight a step skips gets a zero gradient, not None).
    A deep copy of the model (an EMA) keeps TE's flag but no ``main_grad``: train only the
    original."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        self.weights = [weight for module in modules for weight in weight_params(module)]
        for module in modules:
            module.fuse_wgrad_accumulation = True

    def _link(self) -> None:
        fresh = []
        for weight in self.weights:
            if not weight.requires_grad:  # frozen since: no gradient at all
                continue
            grad = getattr(weight, "main_grad", None)
            if grad is None or grad.device != weight.device or grad.shape != weight.shape:
                grad = weight.main_grad = torch.empty_like(weight, dtype=torch.float32)
            if weight.grad is None:
                fresh.append(grad)
            elif weight.grad is not grad:  # autograd's or a moved one: the sum so far
                grad.copy_(weight.grad)
            weight.grad = grad
        if fresh:
            torch._foreach_zero_(fresh)

    def before_forward(self) -> None:
        """A ``main_grad`` on each weight's device, linked as its ``.grad`` (before a capture,
        which records where TE writes)."""
        self._link()

    def before_backward(self) -> None:
        """Each ``.grad`` is ``main_grad`` (zero where ``.grad`` was dropped): TE adds into it,
        autograd adds what reaches the weight elsewhere."""
        self._link()

    def remove(self) -> None:
        """TE's own weight gradients again; a ``.grad`` linked so far stays as it is."""
        for module in self.modules:
            module.fuse_wgrad_accumulation = False
        for weight in self.weights:
            weight.__dict__.pop("main_grad", None)
