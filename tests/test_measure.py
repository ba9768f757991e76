"""``fp8_lightning.measure``: bench's variant names and the training step it builds through the
training module (what ``bench``, ``doctor`` and ``engine: auto`` time)."""

import pytest
import torch

from fp8_lightning.config import ConfigError, GPTConfig
from fp8_lightning.measure import DEFAULT_VARIANTS, build_step, parse_variant
from fp8_lightning.module import GPTLightningModule

CONFIG = dict(name="tiny", vocab_size=512)  # the quickstart model, a small vocabulary


def test_variant_names():
    v = parse_variant("fp8-current-bf16ends-te-attn")
    # TE variants compile and replay CUDA graphs as fit does; the suffixes turn each off
    assert (v.backend, v.recipe, v.attention, v.bf16_ends, v.compile, v.graphs) == \
        ("te", "current", "te", True, True, True)
    v = parse_variant("fp8-delayed-nograph-eager")
    assert (v.recipe, v.compile, v.graphs) == ("delayed", False, False)
    # torchao variants replay the compiled model as CUDA graphs, as fit does; the baseline never
    v = parse_variant("fp8-tensorwise")
    assert (v.backend, v.compile, v.graphs) == ("torch", True, True)
    assert not parse_variant("fp8-tensorwise-nograph").graphs
    assert not parse_variant("torch-compile").graphs
    assert parse_variant("torch-compile").compile and not parse_variant("torch-eager").compile
    v = parse_variant("fp8-delayed-fp8-attn-fp8-head")  # FP8 attention implies TE attention
    assert (v.attention, v.fp8_attention, v.fp8_head) == ("te", True, True)
    assert all(parse_variant(name) for name in DEFAULT_VARIANTS)
    assert parse_variant("fp8-delayed-te-attn").fp32_residual is None  # the backend's default
    assert parse_variant("fp8-delayed-te-attn-fp32res").fp32_residual is True
    assert parse_variant("fp8-tensorwise-bf16res").fp32_residual is False
    assert parse_variant("fp8-tensorwise-autolayers").fp8_layers == "auto"
    assert parse_variant("fp8-tensorwise-alllayers").fp8_layers == "all"
    assert parse_variant("fp8-tensorwise").fp8_layers is None  # the config's, else the recipe's
    assert parse_variant("fp8-delayed-recent-te-attn").amax_history == "recent"
    assert parse_variant("fp8-delayed-hist1024-te-attn").amax_history == "hist1024"
    assert parse_variant("fp8-delayed").amax_history is None  # the config's
    for bad, message in (("fp9-delayed", "valid: torch-eager"),
                         ("te-bf16-fp32res-bf16res", "-fp32res or -bf16res, not both"),
                         ("torch-compile-ac-mlp-ac-full", "-ac-full or -ac-mlp, not both"),
                         ("torch-eager-te-attn", "-te-attn needs a TE variant"),
                         ("te-bf16-bf16ends", "-bf16ends needs an FP8 variant"),
                         ("torch-compile-nograph", "-nograph needs a TE or an FP8 variant"),
                         ("te-bf16-fp8-head", "-fp8-head needs an FP8 variant"),
                         ("torch-compile-autolayers", "-autolayers needs an FP8 variant"),
                         ("fp8-rowwise-autolayers-alllayers", "-autolayers or -alllayers, not"),
                         ("fp8-block-fp8-attn", "-fp8-attn needs fp8-delayed or fp8-current"),
                         ("fp8-current-recent", "-recent needs fp8-delayed"),
                         ("fp8-block-hist1024", "-hist1024 needs fp8-delayed"),
                         ("fp8-delayed-recent-hist1024", "-recent or -hist1024, not both")):
        with pytest.raises(ConfigError, match=message):
            parse_variant(bad)


def test_the_residual_and_checkpointing_suffixes_reach_the_model_the_step_trains():
    config = GPTConfig.from_name("tiny")
    for name, fp32 in (("torch-eager", True), ("torch-eager-bf16res", False)):
        step, _ = build_step(parse_variant(name), config, 2, 16, device=torch.device("cpu"),
                             module_class=GPTLightningModule)
        assert step.module.model.fp32_residual is fp32, name
        assert torch.isfinite(step())
    step, _ = build_step(parse_variant("torch-eager-ac-full"), config, 2, 16,
                         device=torch.device("cpu"), module_class=GPTLightningModule)
    assert step.module.model.checkpointed == {0, 1} and torch.isfinite(step())


def test_bench_times_the_modules_training_step():
    config = GPTConfig(**CONFIG)
    step, plugin = build_step(parse_variant("torch-eager"), config, 2, 32,
                              device=torch.device("cpu"), module_class=GPTLightningModule)
    module = step.module
    assert isinstance(module, GPTLightningModule) and plugin is None and module.compiled is None
    before = [p.detach().clone() for p in module.parameters()]
    loss = step()
    assert torch.isfinite(loss)
    assert all(not torch.equal(a, p) for a, p in zip(before, module.parameters()) if p.ndim == 2)
