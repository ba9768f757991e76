"""A user's ``LayerNorm -> Linear -> GELU(tanh) -> Linear`` as one fused MLP module
(``fp8_lightning/fp8/mlp_fusion.py``, ``Speedups(fuse_mlp=True)``): which chains fuse, and a
fused block computing what the user's block computes, with the user's checkpoint keys. TE's
``te.LayerNormMLP`` needs a GPU (tests/test_gpu_any_model.py); here the package's PyTorch twin of
it, with TE's parameter names, stands in for it."""

import importlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp8_lightning.fp8.mlp_fusion import FusedLinear, MLPChain, fuse_block, mlp_chains
from fp8_lightning.fp8.norm_fusion import FusedNorm
from fp8_lightning.fp8.policy import find_blocks
from fp8_lightning.fp8.te_engine import drop_extra_state, expect_no_extra_state
from fp8_lightning.layers import TorchLayerNormMLP, normal_init


def twin_mlp(norm, fc1, fc2):
    """What te_mlp_like builds, with the PyTorch twin of te.LayerNormMLP."""
    mlp = TorchLayerNormMLP(fc1.in_features, fc1.out_features, bias=fc1.bias is not None,
                            norm="layernorm", eps=norm.eps, activation="gelu",
                            init_method=normal_init(0.02), output_layer_init_method=normal_init(0.02))
    mlp.layer_norm_weight, mlp.layer_norm_bias = norm.weight, norm.bias
    mlp.fc1_weight, mlp.fc1_bias, mlp.fc2_weight, mlp.fc2_bias = \
        fc1.weight, fc1.bias, fc2.weight, fc2.bias
    mlp.register_state_dict_post_hook(drop_extra_state)  # as the TE engine's convert does
    mlp.register_load_state_dict_pre_hook(expect_no_extra_state)
    return mlp


def fuse(model):
    prefix, _ = find_blocks(model)
    chains, why = mlp_chains(model.get_submodule(prefix))
    for i, block in enumerate(model.get_submodule(prefix)):
        _, refused = fuse_block(block, [c for c in chains if c.block == i], f"{prefix}.{i}",
                                twin_mlp)
        assert refused == ""
    return chains, why


def nanogpt():
    torch.manual_seed(0)
    own = importlib.import_module("examples.own_model")
    return own, own.NanoGPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def test_the_examples_mlp_fuses_and_its_block_computes_what_the_users_does():
    own, model = nanogpt()
    user = copy.deepcopy(model)
    chains, why = fuse(model)
    assert why == "" and chains == [MLPChain(i, "ln_2", "c_fc", "mlp_proj") for i in range(2)]
    block = model.transformer.h[0]
    assert isinstance(block, own.Block)  # a subclass with the fused forward
    assert isinstance(block.c_fc, TorchLayerNormMLP) and isinstance(block.ln_2, FusedNorm)
    assert isinstance(block.mlp_proj, FusedLinear)
    assert block.c_fc.fc2_weight is block.mlp_proj.weight  # one parameter, two holders
    idx = torch.randint(0, 64, (2, 16))
    with torch.no_grad():  # in eval() too
        torch.testing.assert_close(model.eval()(idx), user.eval()(idx), rtol=0, atol=0)
    out, ref = model.train()(idx), user.train()(idx)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out.square().mean().backward()
    ref.square().mean().backward()
    # every parameter under the user's name: the norm's and fc2's in their holders, fc1's in
    # the fused module (TE's names)
    mine = dict(model.named_parameters(remove_duplicate=False))
    for name, p in user.named_parameters():
        fused = mine.get(name)
        if fused is None:
            fused = mine[name.replace(".c_fc.", ".c_fc.fc1_")]
        torch.testing.assert_close(fused.grad, p.grad, rtol=0, atol=0, msg=name)


def test_a_fused_models_checkpoint_has_the_users_keys_and_loads_both_ways():
    _, model = nanogpt()
    user = copy.deepcopy(model)
    fuse(model)
    assert model.state_dict().keys() == user.state_dict().keys()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, user.state_dict()[key], rtol=0, atol=0, msg=key)
    with torch.no_grad():
        for p in user.parameters():
            p.add_(1.0)
    model.load_state_dict(user.state_dict(), strict=True)  # the user's checkpoint, fused model
    idx = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(model(idx), user(idx), rtol=0, atol=0)
    _, plain = nanogpt()
    plain.load_state_dict(model.state_dict(), strict=True)  # the fused model's, the user's model
    torch.testing.assert_close(plain(idx), user(idx), rtol=0, atol=0)


def test_a_deep_copy_of_a_fused_model_computes_the_same_with_its_own_shared_parameters():
    _, model = nanogpt()
    fuse(model)
    idx = torch.randint(0, 64, (2, 16))
    twin = copy.deepcopy(model)
    torch.testing.assert_close(twin(idx), model(idx), rtol=0, atol=0)
    block = twin.transformer.h[0]
    assert block.c_fc.fc2_weight is block.mlp_proj.weight
    assert block.c_fc.layer_norm_weight is block.ln_2.weight
    assert block.c_fc.fc1_weight is not model.transformer.h[0].c_fc.fc1_weight


class NoBias(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d, bias=False), \
            nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x)), approximate="tanh"))


def test_strict_loading_of_a_fused_block_reports_a_missing_key_and_takes_no_bias():
    blocks = nn.ModuleList([NoBias()])
    user = copy.deepcopy(blocks)
    chains, _ = mlp_chains(blocks)
    fused, why = fuse_block(blocks[0], chains, "h.0", twin_mlp)
    assert why == "" and len(fused) == 1
    assert blocks.state_dict().keys() == user.state_dict().keys()
    blocks.load_state_dict(user.state_dict(), strict=True)
    partial = {k: v for k, v in user.state_dict().items() if k != "0.fc1.weight"}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*0\.fc1\.fc1_weight"):
        blocks.load_state_dict(partial, strict=True)


class Variants(nn.Module):
    """Four MLPs: exact GELU, an nn.GELU("tanh") module, fc1's output read twice, no biases."""

    def __init__(self, d=16):
        super().__init__()
        self.ln_a, self.ln_b, self.ln_c, self.ln_d = (nn.LayerNorm(d) for _ in range(4))
        self.a1, self.a2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.b1, self.b2, self.act = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.GELU("tanh")
        self.c1, self.c2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.d1, self.d2 = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        x = x + self.a2(F.gelu(self.a1(self.ln_a(x))))           # exact (erf) GELU: not TE's
        x = x + self.b2(self.act(self.b1(self.ln_b(x))))         # fuses
        h = self.c1(self.ln_c(x))
        x = x + self.c2(F.gelu(h, approximate="tanh")) + h[..., :16]  # fc1 read twice: not
        return x + self.d2(F.gelu(self.d1(self.ln_d(x)), approximate="tanh"))  # fuses


def test_only_chains_that_compute_the_same_in_te_fuse():
    blocks = nn.ModuleList([Variants()])
    chains, _ = mlp_chains(blocks)
    assert chains == [MLPChain(0, "ln_b", "b1", "b2"), MLPChain(0, "ln_d", "d1", "d2")]
    user = copy.deepcopy(blocks[0])
    assert fuse_block(blocks[0], chains, "h.0", twin_mlp)[1] == ""
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(blocks[0](x), user(x), rtol=0, atol=0)


class Branching(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: torch.fx cannot trace it
            x = x * 2
        return x + self.fc2(F.gelu(self.fc1(self.ln(x)), approximate="tanh"))


class Attention(nn.Module):
    """A submodule the fused forward keeps as one call: its train()/eval() branch and its None
    check run as the user wrote them."""

    def __init__(self, d=16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5 if self.training else 0.0,
                                              is_causal=mask is None)


class Nested(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.attn, self.ln = Attention(d), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU("tanh"), nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.attn(x) + self.mlp(self.ln(x))


class TrainOnly(Nested):
    def forward(self, x):
        x = F.dropout(x, 0.1, training=self.training)  # the block's own code branches on it
        return x + self.mlp(self.ln(x))


class WithDefault(Nested):
    def forward(self, x, scale=None):
        return x + self.mlp(self.ln(x)) * (1.0 if scale is None else scale)


def test_a_fused_block_keeps_its_other_submodules_as_they_run():
    blocks = nn.ModuleList([Nested()])
    chains, _ = mlp_chains(blocks)
    assert chains == [MLPChain(0, "ln", "mlp.0", "mlp.2")]
    user = copy.deepcopy(blocks[0])
    assert fuse_block(blocks[0], chains, "h.0", twin_mlp)[1] == ""
    x = torch.randn(2, 5, 16)
    with torch.no_grad():  # eval(): no attention dropout, as the user's attention has it
        torch.testing.assert_close(blocks[0].eval()(x), user.eval()(x), rtol=0, atol=0)


@pytest.mark.parametrize("block, why", [
    (TrainOnly(), "differs between train() and eval()"),
    (WithDefault(), "takes an argument with a default"),
])
def test_a_block_whose_trace_would_not_hold_for_every_call_keeps_its_mlp(block, why):
    blocks = nn.ModuleList([block])
    chains, _ = mlp_chains(blocks)
    assert chains  # the chain is there; its block's trace cannot stand for the block
    fused, refused = fuse_block(blocks[0], chains, "h.0", twin_mlp)
    assert fused == [] and why in refused
    assert type(blocks[0]) is type(block) and isinstance(blocks[0].mlp[0], nn.Linear)


def test_a_block_fx_cannot_trace_keeps_its_mlp_and_says_why():
    chains, why = mlp_chains(nn.ModuleList([Branching()]))
    assert chains == [] and "block 0 cannot be traced by torch.fx" in why


def test_the_fc2_holder_is_never_called_by_the_fused_forward():
    _, model = nanogpt()
    fuse(model)
    with pytest.raises(RuntimeError, match="runs inside transformer.h.0.c_fc"):
        model.transformer.h[0].mlp_proj(torch.randn(2, 128))
