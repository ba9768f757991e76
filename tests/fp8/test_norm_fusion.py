"""Which of a user's LayerNorms the TE engine computes inside the GEMM module after them
(``fp8_lightning/fp8/norm_fusion.py``): only a norm whose output feeds one ``nn.Linear`` and
nothing else, as the block's traced graph shows. The swap itself (``te.LayerNormLinear``) needs
TE on a GPU (tests/test_gpu_any_model.py)."""

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp8_lightning.fp8.norm_fusion import FusedNorm, fusable_pairs
from fp8_lightning.fp8.policy import find_blocks


def test_the_examples_two_norms_per_block_go_into_the_gemm_after_them():
    own = importlib.import_module("examples.own_model")
    model = own.NanoGPT(vocab_size=512, block_size=64, n_layer=3, n_head=4, n_embd=128)
    prefix, n = find_blocks(model)
    pairs, why = fusable_pairs(model.get_submodule(prefix), prefix)
    assert why == ""
    assert pairs == {f"transformer.h.{i}.{linear}": f"transformer.h.{i}.{norm}"
                     for i in range(n) for linear, norm in (("c_attn", "ln_1"), ("c_fc", "ln_2"))}


class Shared(nn.Module):
    """Pre-norm attention whose normalised input is also the residual, and a norm called twice."""

    def __init__(self, d=32):
        super().__init__()
        self.ln_1, self.ln_2, self.ln_3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.fc, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.no_bias = nn.LayerNorm(d, bias=False)
        self.after_no_bias = nn.Linear(d, d)

    def forward(self, x):
        h = self.ln_1(x)
        x = h + self.q(h)                            # the norm's output read twice: not fused
        x = x + self.fc(self.ln_2(x)) + self.fc(x)   # a linear called twice: not fused
        x = self.out(self.ln_3(self.ln_3(x)))        # a norm called twice: not fused
        return self.after_no_bias(F.gelu(self.no_bias(x)))  # no bias, and GELU between: not fused


def test_a_norm_read_elsewhere_called_twice_or_without_bias_stays_a_norm():
    blocks = nn.ModuleList([Shared(), Shared()])
    pairs, why = fusable_pairs(blocks, "layers")
    assert pairs == {} and why == "no norm feeds one nn.Linear alone"


def test_a_block_fx_cannot_trace_keeps_its_norms_and_says_why():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow
                return self.fc(self.ln(x))
            return x

    pairs, why = fusable_pairs(nn.ModuleList([Branchy()]), "blocks")
    assert pairs == {} and why.startswith("blocks.0 cannot be traced by torch.fx (")


def test_hugging_face_llamas_rmsnorms_feed_several_projections_and_stay():
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    prefix, _ = find_blocks(model)
    pairs, why = fusable_pairs(model.get_submodule(prefix), prefix)
    assert pairs == {} and why


def test_a_fused_norm_is_the_identity_holding_the_norms_own_parameters():
    norm = nn.LayerNorm(8)
    fused = FusedNorm(norm, "blocks.0.c_attn")
    x = torch.randn(2, 8)
    assert torch.equal(fused(x), x)
    assert fused.weight is norm.weight and fused.bias is norm.bias
    assert list(fused.state_dict()) == ["weight", "bias"]
    assert "computed in blocks.0.c_attn" in repr(fused)
