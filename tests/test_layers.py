"""The layer factory (``fp8_lightning.layers``): the PyTorch layers carry TE's parameter names
and follow TE's semantics, so one model definition and one checkpoint serve both backends."""

import torch
import torch.nn.functional as F

from fp8_lightning.config import GPTConfig
from fp8_lightning.model import GPT


def test_parameter_names_are_transformer_engine_names():
    """The torch backend's state_dict keys are the TE modules' keys (checked on GPU too)."""
    model = GPT(GPTConfig.from_name("tiny", n_layer=1))
    keys = set(model.state_dict())
    block = {f"blocks.0.{k}" for k in (
        "qkv.layer_norm_weight", "qkv.layer_norm_bias", "qkv.weight", "qkv.bias", "qkv._extra_state",
        "core._extra_state", "proj.weight", "proj.bias", "proj._extra_state",
        "mlp.layer_norm_weight", "mlp.layer_norm_bias", "mlp.fc1_weight", "mlp.fc1_bias",
        "mlp.fc2_weight", "mlp.fc2_bias", "mlp._extra_state")}
    top = {"wte.weight", "wpe.weight", "norm_f.weight", "norm_f.bias", "norm_f._extra_state",
           "lm_head.weight", "lm_head._extra_state"}
    assert keys == block | top


def test_swiglu_follows_te_convention_gate_first():
    from fp8_lightning.layers import TorchLayerNormMLP, normal_init

    mlp = TorchLayerNormMLP(16, 16, bias=False, norm="rmsnorm", eps=1e-5, activation="swiglu",
                            init_method=normal_init(0.02), output_layer_init_method=normal_init(0.02))
    x = torch.randn(3, 16)
    h = F.linear(F.rms_norm(x, (16,), mlp.layer_norm_weight, 1e-5), mlp.fc1_weight)
    expected = F.linear(F.silu(h[:, :16]) * h[:, 16:], mlp.fc2_weight)
    torch.testing.assert_close(mlp(x), expected)
