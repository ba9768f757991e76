"""cuDNN's fused attention first for ``F.scaled_dot_product_attention`` in the plugin's forwards
and backwards (an activation checkpoint's recompute picks its backend again there).

PyTorch may run FlashAttention 2's kernels for a user's eager model where the same model
compiled runs cuDNN's, which spend less time on attention on Hopper (docs/fp8.md). Recent PyTorch
builds put cuDNN first on Hopper themselves when their cuDNN is new enough; where the order
already starts with cuDNN this changes nothing. Only an order: a call cuDNN cannot serve takes
the next backend, and the enabled backends stay as the user set them.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch


# PyTorch puts cuDNN's attention first on Hopper only from cuDNN 9.15.1: older ones had memory
# errors at sequence lengths that are not a multiple of 128 (pytorch/pytorch#169849)
CUDNN_SAFE = 91500


def prefer_cudnn(setting: Optional[bool], device_type: str,
                 capability: Optional[tuple[int, int]], cudnn: Optional[int] = None
                 ) -> tuple[bool, str]:
    """Whether the plugin's forwards put cuDNN's attention first (``Speedups``'
    ``cudnn_attention``: None is on for Hopper, sm90, with a cuDNN newer than 9.15.0), and why."""
    if setting is False:
        return False, "cudnn_attention=false"
    if device_type != "cuda":
        return False, "no GPU"
    if setting is None and capability != (9, 0):
        return False, f"sm{''.join(map(str, capability or ()))}: PyTorch's order kept off Hopper"
    if setting is None and (cudnn or 0) <= CUDNN_SAFE:
        return False, (f"cuDNN {cudnn or 'unavailable'}: its attention is preferred from 9.15.1 "
                       "on (pytorch/pytorch#169849); cudnn_attention=true asks regardless")
    return True, "cudnn_attention=true" if setting else f"Hopper, cuDNN {cudnn}"


# torch.nn.attention.sdpa_kernel(set_priority=True) also sets which backends are enabled and,
# from PyTorch 2.11, puts back the order of the enabled ones only (a disabled backend ends up
# last for good): the order alone is set and restored here, with the functions it uses itself.
_GET = getattr(torch._C, "_get_sdp_priority_order", None)
_SET = getattr(torch._C, "_set_sdp_priority_order", None)


def cudnn_is_first() -> bool:
    """Does PyTorch's order (now) try cuDNN's attention first?"""
    from torch.nn.attention import SDPBackend

    return _GET is not None and list(_GET())[:1] == [int(SDPBackend.CUDNN_ATTENTION)]


def settle_order(device: torch.device) -> None:
    """One backend choice on tiny tensors, so that a PyTorch which sets its Hopper order at the
    first attention call has set it before :func:`cudnn_first` reads it. Nothing where no
    backend takes them (the user disabled those that would)."""
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return
    q = torch.zeros(1, 8, 1, 64, device=device, dtype=torch.bfloat16)
    q = q.transpose(1, 2)  # (B, nh, T, hs), laid out as a model's heads are
    try:
        torch._fused_sdp_choice(q, q, q, is_causal=True)
    except RuntimeError:
        pass


@contextmanager
def cudnn_first() -> Iterator[None]:
    """cuDNN first, the other backends in their order after it; the order put back after."""
    from torch.nn.attention import SDPBackend

    cudnn = int(SDPBackend.CUDNN_ATTENTION)
    if _GET is None or _SET is None or not torch.backends.cuda.cudnn_sdp_enabled():
        yield
        return
    before = list(_GET())
    if before[:1] == [cudnn]:
        yield
        return
    _SET([cudnn] + [b for b in before if b != cudnn])
    try:
        yield
    finally:
        _SET(before)
