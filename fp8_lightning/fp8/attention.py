"""cuDNN's fused attention first for ``F.scaled_dot_product_attention`` in the plugin's forwards.

PyTorch tries FlashAttention 2 before cuDNN. On Hopper cuDNN's kernels are the faster ones for
training shapes (a user's nanoGPT 1.3B on an H100: 15.1 ms of eager attention a step against
9.8 ms where the compiled BF16 model got cuDNN's; transformers prefers cuDNN on Hopper likewise,
huggingface/transformers#48163). Only an order: a call cuDNN cannot serve takes the next backend,
and a backend the user disabled stays disabled.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch


def prefer_cudnn(setting: Optional[bool], device_type: str,
                 capability: Optional[tuple[int, int]]) -> tuple[bool, str]:
    """Whether the plugin's forwards put cuDNN's attention first (``cudnn_attention``: None is
    on for Hopper, sm90), and why."""
    if setting is False:
        return False, "cudnn_attention=false"
    if device_type != "cuda":
        return False, "no GPU"
    if setting is None and capability != (9, 0):
        return False, f"sm{''.join(map(str, capability or ()))}: PyTorch's order kept off Hopper"
    return True, "cudnn_attention=true" if setting else "Hopper"


@contextmanager
def cudnn_first() -> Iterator[None]:
    """cuDNN first among the attention backends enabled now, in PyTorch's order after it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cuda = torch.backends.cuda
    enabled = [backend for backend, on in (
        (SDPBackend.CUDNN_ATTENTION, cuda.cudnn_sdp_enabled()),
        (SDPBackend.FLASH_ATTENTION, cuda.flash_sdp_enabled()),
        (SDPBackend.EFFICIENT_ATTENTION, cuda.mem_efficient_sdp_enabled()),
        (SDPBackend.MATH, cuda.math_sdp_enabled())) if on]
    if not enabled or enabled[0] != SDPBackend.CUDNN_ATTENTION:  # the user turned cuDNN off
        yield
        return
    with sdpa_kernel(enabled, set_priority=True):
        yield
