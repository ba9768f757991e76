"""cuDNN's attention first in the plugin's forwards of a user's model: when, and that it is only
an order over the backends the user left enabled (the kernels themselves run on the GPU:
tests/test_gpu_any_model.py)."""

import pytest
import torch
from torch.nn.attention import SDPBackend

from fp8_lightning.fp8.attention import cudnn_first, cudnn_is_first, prefer_cudnn


@pytest.mark.parametrize("setting, device, capability, cudnn, expected", [
    (None, "cuda", (9, 0), 91900, (True, "Hopper, cuDNN 91900")),
    (None, "cuda", (9, 0), 91500, (False, "cuDNN 91500: its attention is preferred from 9.15.1")),
    (None, "cuda", (9, 0), None, (False, "cuDNN unavailable: its attention is preferred")),
    (None, "cuda", (8, 0), 91900, (False, "sm80: PyTorch's order kept off Hopper")),
    (None, "cuda", (10, 0), 91900, (False, "sm100: PyTorch's order kept off Hopper")),
    (True, "cuda", (8, 0), 90100, (True, "cudnn_attention=true")),
    (False, "cuda", (9, 0), 91900, (False, "cudnn_attention=false")),
    (True, "cpu", None, None, (False, "no GPU")),
])
def test_cudnn_goes_first_on_hopper_with_a_safe_cudnn_or_when_asked(setting, device, capability,
                                                                    cudnn, expected):
    first, why = prefer_cudnn(setting, device, capability, cudnn)
    assert first == expected[0] and why.startswith(expected[1]), why


def order() -> list[SDPBackend]:
    return [SDPBackend(b) for b in torch._C._get_sdp_priority_order()]


def test_cudnn_first_moves_only_cudnn_and_puts_the_order_back_exactly():
    before = order()
    assert before[0] != SDPBackend.CUDNN_ATTENTION  # PyTorch's order on this CPU build
    torch.backends.cuda.enable_flash_sdp(False)  # the user's choice: stays as it is
    try:
        with cudnn_first():
            assert order() == [SDPBackend.CUDNN_ATTENTION] + [
                b for b in before if b != SDPBackend.CUDNN_ATTENTION]
            assert cudnn_is_first() and not torch.backends.cuda.flash_sdp_enabled()
        assert order() == before and not torch.backends.cuda.flash_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN off: the order is left alone
        with cudnn_first():
            assert order() == before
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
        torch.backends.cuda.enable_cudnn_sdp(True)
    assert order() == before


def test_an_order_that_starts_with_cudnn_is_left_alone():
    before = order()
    with cudnn_first():
        inside = order()
        with cudnn_first():  # nested (a backward's recompute inside a forward's context)
            assert order() == inside
        assert order() == inside
    assert order() == before
