"""The FP8 component: the recipe registry, the engines behind one plugin, the typed accessor.

torchao's float8 GEMMs run on a CPU (``torch._scaled_mm`` has a CPU kernel), so the torchao
engine's conversion, switch and checkpoints are tested here for real; its speed and the TE engine
are tested on the GPU (``-m gpu``)."""

import os

import pytest
import torch

from fp8_lightning.config import ConfigError, GPTConfig
from fp8_lightning.fp8 import (ENGINES, RECIPES, FP8Precision, build_recipe_config, engine_backend,
                               fp8_plugin, get_engine, recipe_names)
from fp8_lightning.model import GPT
from fp8_lightning.module import GPTLightningModule

torchao = pytest.importorskip("torchao")  # the [torchao] extra, part of [dev]
CONFIG = GPTConfig(name="tiny", n_layer=2, vocab_size=512)


def test_every_recipe_names_a_known_engine_and_validates_its_fields():
    assert set(recipe_names("te")) == {"delayed", "current", "block", "mxfp8"}
    assert set(recipe_names("torchao")) == {"tensorwise", "rowwise", "rowwise_with_gw_hp"}
    for name, recipe in RECIPES.items():
        assert recipe.engine in ENGINES and engine_backend(recipe.engine) in ("te", "torch")
        assert build_recipe_config(name)["recipe"] == name
    assert [r for r, e in RECIPES.items() if e.stateful] == ["delayed"]  # the amax history
    with pytest.raises(ConfigError, match="fp8_format is not a field of recipe='tensorwise'"):
        build_recipe_config("tensorwise", fp8_format="e4m3")


def test_engine_and_recipe_must_agree():
    assert FP8Precision().recipe_config["recipe"] == "delayed"  # the default: TE, delayed
    assert FP8Precision(engine="torchao").recipe_config["recipe"] == "tensorwise"
    assert FP8Precision(recipe="rowwise").engine.name == "torchao"
    with pytest.raises(ConfigError, match="recipe='delayed' runs on engine 'te'; valid recipes "
                                          "for engine='torchao': tensorwise, rowwise"):
        FP8Precision(recipe="delayed", engine="torchao")
    with pytest.raises(ConfigError, match="engine='jax'; valid: te, torchao"):
        FP8Precision(engine="jax")


def test_torchao_without_a_gpu_falls_back_with_the_reason():
    plugin = FP8Precision(engine="torchao")
    plugin.convert_module(GPT(CONFIG))
    assert not plugin.fp8_active and "no CUDA GPU" in plugin.reason
    assert plugin.history[-1]["event"] == "unavailable"


def make_pair(recipe):
    """A tiny PyTorch-backend GPT converted by the torchao engine, and an unconverted twin."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    twin = GPT(CONFIG)
    twin.load_state_dict(model.state_dict())
    engine = get_engine("torchao")
    keep = {"lm_head": "fp8_lm_head=false"}
    engine.convert(model, build_recipe_config(recipe), keep)
    return engine, model, twin


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_torchao_engine_runs_float8_gemms_and_switches_back(recipe):
    engine, model, twin = make_pair(recipe)
    assert sorted(engine.modules_ran(model)) == sorted(
        f"blocks.{i}.{m}" for i in range(2) for m in ("qkv", "proj", "mlp"))  # not the head
    idx = torch.randint(0, 512, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fp8_loss, bf16_loss = model(idx, idx), twin(idx, idx)
    fp8_loss.backward()
    # Float8 quantisation really happened (not BF16 under another name) and stays close.
    assert fp8_loss.item() != bf16_loss.item()
    assert abs(fp8_loss.item() - bf16_loss.item()) < 0.05 * bf16_loss.item()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    engine.set_enabled(model, False)  # the BF16 fallback: F.linear again, the twin's numbers
    assert engine.modules_ran(model) == []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(idx, idx), twin(idx, idx))


def test_fp8_layers_auto_on_torchao_asks_torchaos_size_filter_per_gemm():
    """At GPT-2 124M torchao's tensorwise thresholds (no float8 where K <= 4096 and N <= 1024)
    keep the attention projection whole and the MLP's fc2 (one GEMM of the fused module) BF16;
    rowwise's keep every GEMM of that size BF16; rowwise_with_gw_hp has no filter."""
    engine = get_engine("torchao")
    with torch.device("meta"):
        gpt2 = GPT(GPTConfig.from_name("gpt2"))
    gemms, keep = engine.gemm_modules(gpt2), {"lm_head": "fp8_lm_head=false"}
    kept, how = engine.auto_bf16(gemms, keep, build_recipe_config("tensorwise"), None)
    assert how == "by torchao's size filter for tensorwise"
    assert sorted(kept) == sorted([f"blocks.{i}.proj" for i in range(12)]
                                  + [f"blocks.{i}.mlp.fc2_weight" for i in range(12)])
    assert kept["blocks.3.mlp.fc2_weight"] == \
        "fp8_layers=auto: torchao's tensorwise size filter (3072->768)"
    kept, _ = engine.auto_bf16(gemms, keep, build_recipe_config("rowwise"), None)
    assert sorted(kept) == sorted(f"blocks.{i}.{m}" for i in range(12)
                                  for m in ("qkv", "proj", "mlp"))
    assert kept["blocks.0.mlp"] == ("fp8_layers=auto: torchao's rowwise size filter (768->3072); "
                                    "fp8_layers=auto: torchao's rowwise size filter (3072->768)")
    kept, how = engine.auto_bf16(gemms, keep, build_recipe_config("rowwise_with_gw_hp"), None)
    assert kept == {} and "no torchao size filter for rowwise_with_gw_hp" in how


def test_torchao_runs_one_gemm_of_a_fused_module_in_float8_and_the_other_bf16():
    """A model whose fc1 (64 -> 1040) passes tensorwise's filter and nothing else does: each
    forward runs exactly one float8 GEMM per block, and the loss still trains."""
    config = GPTConfig(name="tiny", n_layer=2, vocab_size=512, n_embd=64, n_head=4,
                       ffn_hidden=1040)
    torch.manual_seed(0)
    model = GPT(config)
    engine = get_engine("torchao")
    keep = {"lm_head": "fp8_lm_head=false"}
    kept, _ = engine.auto_bf16(engine.gemm_modules(model), keep,
                               build_recipe_config("tensorwise"), None)
    assert sorted(kept) == sorted(f"blocks.{i}.{w}" for i in range(2)
                                  for w in ("qkv", "proj", "mlp.fc2_weight"))
    engine.convert(model, build_recipe_config("tensorwise"), {**keep, **kept})
    assert sorted(engine.modules_ran(model)) == ["blocks.0.mlp", "blocks.1.mlp"]
    idx = torch.randint(0, 512, (2, 32))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx, idx)
    scaled_mm = sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_mm")
    assert scaled_mm == 2  # fc1 of each block; qkv, proj, fc2 and the head ran F.linear
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_torchao_checkpoints_are_plain_and_load_into_either_backend_layout():
    engine, model, twin = make_pair("tensorwise")
    state = model.state_dict()
    assert set(state) == set(twin.state_dict())  # TE's names, TE's _extra_state keys
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    fresh = GPT(CONFIG)
    fresh.load_state_dict(state, strict=True)
    assert engine.export_scaling(model) == {}  # dynamic scales: nothing to carry


def test_fp8_plugin_is_the_accessor_for_trainer_module_and_fabric():
    import lightning as L

    plugin = FP8Precision()
    trainer = L.Trainer(plugins=[plugin], accelerator="cpu", logger=False)
    assert fp8_plugin(trainer) is plugin
    assert fp8_plugin(L.Trainer(accelerator="cpu", logger=False)) is None
    from fp8_lightning.fabric import FabricFP8Precision

    fabric_plugin = FabricFP8Precision()
    assert fp8_plugin(L.Fabric(accelerator="cpu", plugins=[fabric_plugin])) is fabric_plugin


def test_unset_fp8_layers_is_the_recipes_measured_faster_policy():
    """Unset, ``fp8_layers`` is the recipe's: torchao's size filter for tensorwise (GPT-2 124M
    0.94x -> 0.98x of compiled BF16 on the H100, 0.95x -> 0.99x on the H200; it passes every GEMM
    of the 1.3B), every GEMM for the others; a run's own value wins."""
    assert FP8Precision(recipe="tensorwise").layers == "auto"
    assert [FP8Precision(recipe=r).layers for r in ("delayed", "current", "rowwise")] == ["all"] * 3
    assert FP8Precision(recipe="tensorwise", fp8_layers="all").layers == "all"
    assert FP8Precision(recipe="delayed", fp8_layers="auto").layers == "auto"
    with torch.device("meta"):
        gpt2 = GPT(GPTConfig.from_name("gpt2"))
    plan = FP8Precision(recipe="tensorwise")._plan_bf16(gpt2)
    assert plan["blocks.0.proj"].startswith("fp8_layers=auto") and "blocks.0.mlp.fc2_weight" in plan
    assert "blocks.0.qkv" not in plan and "blocks.0.mlp" not in plan  # qkv, fc1: float8
    assert FP8Precision(recipe="tensorwise", fp8_layers="all")._plan_bf16(gpt2) == {
        "lm_head": "fp8_lm_head=false"}


def test_a_policy_that_keeps_every_gemm_bf16_says_so_when_fp8_did_not_run():
    """tensorwise's size filter passes no GEMM of the tiny model: the first step finds no float8
    GEMM ran and the run goes on in BF16, saying that the layer policy kept them all."""
    import weakref

    model = GPT(GPTConfig.from_name("tiny"))
    plugin = FP8Precision(recipe="tensorwise")
    plugin.bf16_modules = plugin._plan_bf16(model)
    plugin.engine.convert(model, plugin.recipe_config, plugin.bf16_modules)
    assert plugin.engine.converted == {}
    plugin._model_ref = weakref.ref(model)
    plugin.fp8_available = plugin.fp8_active = plugin._verify_pending = True  # as on a GPU
    with plugin.train_step_context():
        pass
    assert not plugin.fp8_active
    assert ("no torchao GEMM module ran FP8 in the first step (the layer policy keeps every GEMM "
            "BF16, fp8_layers=auto; fp8_layers: all runs them in FP8)") == plugin.reason


def test_fp8_layers_auto_keeps_bf16_the_layers_slower_in_fp8():
    """The policy's measured filter with stubbed timings (the real ones are te.Linear on a GPU):
    a module whose GEMMs together are not faster in FP8 stays BF16, each shape timed once."""
    from fp8_lightning.fp8.policy import slower_in_fp8

    model = GPT(GPTConfig(name="tiny", n_layer=2, vocab_size=512, n_embd=64, n_head=4,
                          ffn_hidden=256))
    gemms = get_engine("torchao").gemm_modules(model)
    calls = []

    def time_shape(shape, fp8):  # FP8 pays only where a dim is 256: the MLP's fc1/fc2
        calls.append((shape, fp8))
        return (0.5 if 256 in shape else 1.2) if fp8 else 1.0

    slower = slower_in_fp8(gemms, {"lm_head": "fp8_lm_head=false"}, time_shape)
    assert sorted(slower) == [f"blocks.{i}.{m}" for i in range(2) for m in ("proj", "qkv")]
    assert slower["blocks.0.proj"] == "fp8_layers=auto: FP8 1.200 ms >= BF16 1.000 ms (64->64)"
    assert len(calls) == len(set(calls)) == 2 * 4  # qkv, proj, fc1, fc2 shapes: once each
    with pytest.raises(ConfigError, match="fp8_layers='some'; valid: all, auto"):
        FP8Precision(fp8_layers="some")


@pytest.fixture
def one_rank(tmp_path):
    """A process group of one (gloo) and its 1-D mesh: FSDP2's all-gather hooks run for real."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_fsdp2_float8_all_gather_hands_the_gemm_float8_and_checkpoints_plain_tensors(one_rank):
    """FSDP2Strategy(float8_all_gather=True)'s engine half: weights wrapped before fully_shard
    arrive at the GEMM as float8, their scales precomputed as torchao computes them, the loss
    that of BF16 gathers; the state dict holds plain tensors that load into an unsharded model."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    from fp8_lightning.distributed import full_tensor, shard_model
    from fp8_lightning.fp8.torchao_engine import forget_float8_scales, precompute_float8_scales

    recipe, keep = build_recipe_config("tensorwise"), {"lm_head": "fp8_lm_head=false"}
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    models, engines, seen = [GPT(CONFIG), GPT(CONFIG)], [], []
    models[1].load_state_dict(models[0].state_dict())
    for i, model in enumerate(models):  # 0: float8 gathers, 1: BF16 gathers
        engines.append(get_engine("torchao"))
        if i == 0:
            pairs, how = engines[0].float8_all_gather(model, recipe, keep)
            assert how == "8 GEMM weights gather as float8 (torchao, tensorwise)"
        shard_model(model, one_rank, mp_policy=mp)
        engines[i].convert(model, recipe, keep)
        model.blocks[0].mlp.register_forward_pre_hook(
            lambda m, args: seen.append(type(m.fc1_weight)))
    weights = [getattr(module, name) for module, name in pairs]
    assert len(weights) == 2 * 4  # qkv, proj, fc1, fc2 per block; the LM head stays BF16
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    idx = torch.randint(0, 512, (2, 33))
    for step in range(3):
        precompute_float8_scales(weights)
        w = weights[0]
        expected = torch.finfo(torch.float8_e4m3fn).max / full_tensor(w).abs().max().double()
        assert torch.allclose(w._local_tensor._precomputed_scale, expected.float())
        losses = []
        for model, optimizer in zip(models, optimizers):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        forget_float8_scales(weights)
        assert w._local_tensor._precomputed_scale is None
        assert seen[-2:] == [Float8TrainingTensor, torch.nn.Parameter], seen[-2:]
        assert abs(losses[0] - losses[1]) < 0.02 * losses[1], (step, losses)
    engines[0].set_enabled(models[0], False)  # the BF16 fallback takes the float8 weight back
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(models[0](idx[:, :-1], idx[:, 1:]))
    state = models[0].state_dict()
    assert all(type(getattr(v, "_local_tensor", v)) is torch.Tensor for v in state.values())
    plain = GPT(CONFIG)
    plain.load_state_dict({k: full_tensor(v) for k, v in state.items()})
    assert torch.equal(plain.blocks[1].mlp.fc2_weight, full_tensor(weights[-1]).detach())
    models[0].load_state_dict(models[1].state_dict())  # into the wrapped shards, in place
    assert torch.equal(full_tensor(weights[0]), full_tensor(models[1].blocks[0].qkv.weight))


def test_fsdp2_strategy_gathers_float8_and_precomputes_the_scales_once_per_optimizer_step(
        tmp_path, monkeypatch):
    """``FSDP2Strategy(float8_all_gather=True)`` through the Trainer, FSDP2 over one CPU rank
    (gloo). torchao's float8 GEMMs run on a CPU; only the engine's hardware check is told yes.
    With two micro-batches per step the scales are computed once per optimizer step, and the
    sharded checkpoint holds plain tensors."""
    import lightning as L
    import torch.distributed as dist
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    from fp8_lightning.checkpoint_files import consolidate_checkpoint
    from fp8_lightning.distributed import FSDP2Strategy
    from fp8_lightning.fp8 import torchao_engine

    monkeypatch.setattr(torchao_engine.TorchaoEngine, "available",
                        lambda self, recipe: (True, "CPU (hardware check skipped)"))
    calls = []
    real = torchao_engine.precompute_float8_scales
    monkeypatch.setattr(torchao_engine, "precompute_float8_scales",
                        lambda weights: calls.append(len(weights)) or real(weights))
    seen = set()

    class Gathered(L.Callback):
        def on_train_start(self, trainer, module):
            module.model.blocks[0].mlp.register_forward_pre_hook(
                lambda m, args: seen.add(type(m.fc1_weight)))

    torch.manual_seed(0)
    module = GPTLightningModule(config=CONFIG, backend="torch", compile=False, warmup_steps=1,
                                lr_decay_steps=10)
    plugin = FP8Precision(recipe="tensorwise", fp8_layers="all")  # the tiny model in float8
    trainer = L.Trainer(max_steps=3, accumulate_grad_batches=2, accelerator="cpu", devices=1,
                        strategy=FSDP2Strategy(float8_all_gather=True,
                                               process_group_backend="gloo"),
                        plugins=[plugin], use_distributed_sampler=False, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[Gathered()],
                        default_root_dir=tmp_path)
    environ = dict(os.environ)  # Lightning sets MASTER_PORT and the rank variables here
    try:
        trainer.fit(module, torch.utils.data.DataLoader(torch.randint(0, 512, (12, 33)),
                                                        batch_size=2))
        assert plugin.fp8_active and seen == {Float8TrainingTensor}
        assert calls == [2 * 4] * 3  # 3 optimizer steps of 2 micro-batches: 8 weights each
        trainer.save_checkpoint(tmp_path / "last.ckpt")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # ...which later tests' subprocesses in this worker would inherit (their rank 0 then
        # listens on this run's port: EADDRINUSE)
        os.environ.clear()
        os.environ.update(environ)
    state = consolidate_checkpoint(tmp_path / "last.ckpt")["state_dict"]
    assert all(type(v) is torch.Tensor for v in state.values())
