"""cuDNN's attention first in the plugin's forwards of a user's model: when, and that it is only
an order over the backends the user left enabled (the kernels themselves run on the GPU:
tests/test_gpu_any_model.py)."""

import pytest
import torch
from torch.nn.attention import SDPBackend

from fp8_lightning.fp8 import FP8Precision
from fp8_lightning.fp8.attention import cudnn_first, prefer_cudnn
from tests._runs import load_script


@pytest.mark.parametrize("setting, device, capability, expected", [
    (None, "cuda", (9, 0), (True, "Hopper")),
    (None, "cuda", (8, 0), (False, "sm80: PyTorch's order kept off Hopper")),
    (None, "cuda", (10, 0), (False, "sm100: PyTorch's order kept off Hopper")),
    (True, "cuda", (8, 0), (True, "cudnn_attention=true")),
    (False, "cuda", (9, 0), (False, "cudnn_attention=false")),
    (True, "cpu", None, (False, "no GPU")),
])
def test_cudnn_goes_first_on_hopper_or_when_asked(setting, device, capability, expected):
    assert prefer_cudnn(setting, device, capability) == expected


def order() -> list[SDPBackend]:
    return [SDPBackend(b) for b in torch._C._get_sdp_priority_order()]


def test_cudnn_first_reorders_only_the_enabled_backends_and_restores_them():
    before = order()
    with cudnn_first():
        assert order()[0] == SDPBackend.CUDNN_ATTENTION
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert order() == before
    torch.backends.cuda.enable_flash_sdp(False)  # the user's choice stays
    try:
        with cudnn_first():
            assert order()[0] == SDPBackend.CUDNN_ATTENTION
            assert not torch.backends.cuda.flash_sdp_enabled()
        assert not torch.backends.cuda.flash_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN off: the order is left alone
        now = order()
        with cudnn_first():
            assert order() == now and not torch.backends.cuda.cudnn_sdp_enabled()
    finally:  # PyTorch restores only the enabled backends' order: put this process's back
        torch.backends.cuda.enable_flash_sdp(True)
        torch.backends.cuda.enable_cudnn_sdp(True)
        torch._C._set_sdp_priority_order([int(b) for b in before])
    assert order() == before


def test_the_plugin_keeps_pytorchs_order_without_a_gpu():
    own = load_script("examples/own_model.py")
    plugin = FP8Precision(recipe="tensorwise", cudnn_attention=True)
    plugin.convert_module(own.LitNanoGPT())
    assert not plugin._cudnn_first
    before = order()
    with plugin.forward_context():
        assert order() == before
