"""One GEMM shape timed on this GPU in TE FP8 and in BF16: what ``fp8_layers: auto`` and the
doctor's benefit probe compare."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from ..te_availability import te_module


@dataclass
class Gemm:
    """One distinct GEMM shape of the model: ``tokens x n_in -> n_out``, and how many of them run
    FP8 / stay BF16 under the layer policy."""

    label: str
    n_in: int
    n_out: int
    bias: bool
    fp8: int = 0
    bf16: int = 0


def gpu_kernel_ms(fn: Any, reps: int) -> float:
    """GPU kernel time (ms) of one ``fn()`` call: the profiler's device time of ``reps`` calls.

    Not wall time: a lone small ``te.Linear`` call is dominated by TE's per-call CPU work, which
    in a real training step overlaps the GPU work of the layers before it (wall-time probing
    misjudges FP8: docs/tools.md).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    # Each kernel's time is "self" time of exactly one op: the sum counts every kernel once.
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / reps


def time_gemm(gemm: Gemm, tokens: int, recipe: Any, *, warmup: int = 3, reps: int = 10) -> float:
    """GPU milliseconds for one forward + backward (dgrad, wgrad) of a ``te.Linear`` of this
    shape, fp32 weights under BF16 autocast as in training; FP8 when ``recipe`` is a TE recipe
    (its quantisation kernels and scaling update included)."""
    te = te_module()
    linear = te.Linear(gemm.n_in, gemm.n_out, bias=gemm.bias, device="cuda")
    x = torch.randn(tokens, gemm.n_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, gemm.n_out, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd() -> None:
        with ExitStack() as stack:
            stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
            if recipe is not None:
                stack.enter_context(te.autocast(enabled=True, recipe=recipe))
            y = linear(x)
        y.backward(grad)
        x.grad = None
        for p in linear.parameters():
            p.grad = None

    for _ in range(warmup):
        fwd_bwd()
    return gpu_kernel_ms(fwd_bwd, reps)
