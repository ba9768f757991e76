"""GPU tests of the PyTorch-native engine (torchao float8 in the PyTorch layers), beside the TE
engine's in test_gpu.py: it trains close to BF16, compiled as users run it, shows float8 kernels,
falls back and re-enables, and bench runs its variants."""

import pytest
import torch

from fp8_lightning.measure import build_step, measure, parse_variant
from fp8_lightning.config import GPTConfig
from fp8_lightning.fp8 import FP8Precision
from fp8_lightning.model import GPT, compile_model
from fp8_lightning.module import GPTLightningModule

from tests.helpers import GPU_B, GPU_SMALL, GPU_T
from tests.test_gpu import eval_loss, tokens, train  # noqa: F401 - the fixture

pytestmark = pytest.mark.gpu
torchao = pytest.importorskip("torchao")


def torch_model(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig.from_name("gpt2", **GPU_SMALL), backend="torch").cuda()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchao_recipe_trains_100_steps_close_to_bf16_compiled(recipe, tokens, capsys):
    reference = torch_model()
    bf16 = FP8Precision(recipe=recipe, fp8_layers="all")  # every GEMM of the small model
    bf16.convert_module(reference)
    bf16.disable_fp8("BF16 reference")
    compile_model(reference)
    ref_losses = train(reference, bf16, tokens, 100)
    model = torch_model()
    plugin = FP8Precision(recipe=recipe, fp8_layers="all")
    plugin.convert_module(model)
    assert plugin.fp8_active and plugin.engine.name == "torchao", plugin.reason
    compile_model(model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        losses = train(model, plugin, tokens, 100)
    kernels = " ".join(e.key for e in prof.key_averages()).lower()
    assert "fp8" in kernels or "e4m3" in kernels or "scaled_mm" in kernels, "no float8 GEMM ran"
    final, ref_final = eval_loss(model, tokens), eval_loss(reference, tokens)
    gap = abs(final - ref_final) / ref_final
    with capsys.disabled():
        print(f"\n[torchao {recipe}] train loss {losses[-1]:.4f} (bf16 {ref_losses[-1]:.4f}), "
              f"eval {final:.4f} (bf16 {ref_final:.4f}), gap {100 * gap:.2f}%")
    assert all(torch.isfinite(torch.tensor(losses))) and gap < 0.02
    plugin.disable_fp8("test")  # the fallback and back, compiled: both states run
    train(model, plugin, tokens, 2, start=100)
    assert plugin.enable_fp8() and plugin.engine.modules_ran(model)
    assert all(torch.isfinite(torch.tensor(train(model, plugin, tokens, 2, start=102))))


def test_bench_runs_the_torchao_variants():
    for name in ("fp8-tensorwise", "fp8-rowwise"):
        result = measure(parse_variant(name), GPTConfig.from_name("gpt2", **GPU_SMALL), GPU_B,
                         GPU_T, steps=3, warmup=2, device=torch.device("cuda"),
                         module_class=GPTLightningModule,
                         fp8_args=dict(recipe=name[4:], fp8_layers="all",
                                       on_unavailable="error"))
        assert result["status"] == "ran" and result["backend"] == "torch", result
        assert result["precision"] == f"FP8 {name[4:]} compiled graphs"  # as fit runs them


def test_torchao_cuda_graphs_train_as_the_compiled_step_does_through_a_fallback(tmp_path, tokens):
    """On one GPU the torchao engine's compiled step replays as CUDA graphs (Inductor's CUDA
    graph trees): the same curve as without them, through a BF16 fallback and back (each state
    its own graphs). "The same" is within what two runs without graphs differ by (atomics in
    the backward kernels: 1.6% at step 30 on an H200, 0.03% on an H100), not a fixed bound."""
    import lightning as L

    from tests.test_gpu import fit

    class FallBack(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 10:
                trainer.precision_plugin.disable_fp8("test", step=10)
            if trainer.global_step == 20:
                trainer.precision_plugin.enable_fp8(step=20)

    def plugin():  # every GEMM of the small model in float8 (tensorwise's filter passes none)
        return FP8Precision(recipe="tensorwise", fp8_layers="all")

    def gap(a, b):
        return max(abs(a[s] - b[s]) / b[s] for s in b)

    _, plain = fit(tmp_path / "plain", tokens, 30, plugin(), cuda_graphs=False,
                   callbacks=[FallBack()])
    _, again = fit(tmp_path / "again", tokens, 30, plugin(), cuda_graphs=False,
                   callbacks=[FallBack()])
    trainer, graphed = fit(tmp_path / "graphs", tokens, 30, plugin(), callbacks=[FallBack()])
    module = trainer.lightning_module
    assert trainer.precision_plugin.fp8_active and module.graphed == "FP8", module.compiled
    assert "CUDA graphs" in module.compiled
    worst, spread = gap(graphed, plain), gap(again, plain)
    print(f"\n[torchao graphs] loss at 30: {graphed[30]:.4f} vs {plain[30]:.4f} without; "
          f"worst relative gap {worst:.4f}, between two runs without graphs {spread:.4f}")
    assert graphed[30] < graphed[1] - 1 and worst < 3 * spread + 0.005


def test_a_replays_loss_survives_the_next_replay():
    """A replay's outputs live in the graphs' memory, which the next replay overwrites: the
    training step returns a copy, so a loss kept across steps (a callback's, a notebook's)
    keeps its value."""
    step, _ = build_step(parse_variant("fp8-tensorwise"), GPTConfig.from_name("gpt2", **GPU_SMALL),
                         GPU_B, GPU_T, device=torch.device("cuda"), module_class=GPTLightningModule,
                         fp8_args=dict(recipe="tensorwise", fp8_layers="all",
                                       on_unavailable="error"))
    losses = [step() for _ in range(4)]  # compile, record, replay, replay
    values = [loss.item() for loss in losses]
    step()
    assert step.module.graphed == "FP8"
    assert [loss.item() for loss in losses] == values and len(set(values)) == 4


def test_bench_runs_torchaos_size_filter_one_gemm_of_a_fused_module_in_float8():
    """``-autolayers`` (``fp8_layers: auto``) on torchao, compiled: with ffn_hidden 2048 only
    fc1 (256 -> 2048) passes tensorwise's size filter; fc2 of the same module stays BF16."""
    config = GPTConfig.from_name("gpt2", **dict(GPU_SMALL, ffn_hidden=2048))
    result = measure(parse_variant("fp8-tensorwise-autolayers"), config, GPU_B, GPU_T, steps=3,
                     warmup=2, device=torch.device("cuda"), module_class=GPTLightningModule,
                     fp8_args=dict(recipe="tensorwise", fp8_layers="auto",
                                   on_unavailable="error"))
    assert result["status"] == "ran", result
    assert {"blocks.0.qkv", "blocks.0.proj", "blocks.0.mlp.fc2_weight"} <= set(
        result["bf16_modules"]) and "blocks.0.mlp" not in result["bf16_modules"]


def test_auto_measures_chooses_and_the_run_trains_what_it_chose(tmp_path, tokens):
    import lightning as L

    from fp8_lightning.module import GPTLightningModule

    plugin = FP8Precision(engine="auto")
    module = GPTLightningModule(GPTConfig.from_name("gpt2", **GPU_SMALL), warmup_steps=2,
                                lr_decay_steps=20)
    trainer = L.Trainer(max_steps=5, plugins=[plugin], accelerator="gpu", devices=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        limit_val_batches=0, default_root_dir=tmp_path)
    loader = torch.utils.data.DataLoader(tokens[: 5 * GPU_B], batch_size=GPU_B)
    trainer.fit(module, loader)
    assert not plugin.auto and " ms" in plugin.auto_figures
    fastest = plugin.auto_figures.split(" ")[0]  # the figures list the fastest first
    if fastest == "torch-compile":
        assert not plugin.fp8_active and "BF16 fastest" in plugin.reason
    else:
        assert plugin.fp8_active and fastest.startswith(f"fp8-{plugin.recipe_config['recipe']}")
        assert module.backend_name == plugin.engine.backend


def test_fp8_layers_auto_times_the_shapes_and_keeps_the_slow_ones_bf16(tokens, caplog):
    import logging

    from tests.test_gpu import make_model

    model = make_model()  # TE backend
    plugin = FP8Precision(fp8_layers="auto")
    plugin.tokens_per_micro_batch = GPU_B * GPU_T
    with caplog.at_level(logging.INFO):
        plugin.convert_module(model)
    assert plugin.fp8_active and "fp8_layers=auto at" in caplog.text
    measured = {k: v for k, v in plugin.bf16_modules.items() if v.startswith("fp8_layers=auto")}
    print(f"\n[fp8_layers=auto] kept BF16: {measured or 'none'}")
    losses = train(model, plugin, tokens, 5)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_torchao_resumes_the_loss_curve_and_its_checkpoint_loads_into_te(tmp_path, tokens):
    """The torchao engine through the Trainer: a run resumed from the uninterrupted run's own
    step-20 checkpoint continues its curve (the same batch every step, so only the training state
    matters), the checkpoint is plain tensors with no scaling state, and it trains on in TE FP8
    delayed."""
    from tests.test_gpu import adam_steps, fit, lrs

    def plugin():  # every GEMM of the small model in float8 (tensorwise's filter passes none)
        return FP8Precision(recipe="tensorwise", fp8_layers="all")

    trainer, straight = fit(tmp_path / "a", tokens, 40, plugin(), save_at=20)
    assert trainer.precision_plugin.engine.name == "torchao"
    at20 = tmp_path / "a" / "at20.ckpt"
    ckpt = torch.load(at20, weights_only=True)  # no pickle anywhere
    assert not (ckpt.get("FP8Precision") or {}).get("scaling")  # scales come from each tensor
    resumed_trainer, resumed = fit(tmp_path / "c", tokens, 40, plugin(), ckpt_path=at20)
    assert resumed_trainer.precision_plugin.fp8_active
    # The schedule and the optimizer's moments came back too: the same learning rate at every
    # step, and Adam counted 40 steps, not 20 (a fresh optimizer would count from the resume).
    assert all(lrs(resumed_trainer)[s] == lrs(trainer)[s] for s in range(21, 41))
    assert adam_steps(resumed_trainer) == adam_steps(trainer) == {40}
    # Step 21's loss is the forward of the restored weights (the uninterrupted run's own step-20
    # state), so only the forward's rounding differs: it checks the weights and the engine's
    # conversion (the moments and the schedule first act on step 22). Later steps drift: the
    # embedding's backward adds atomically, so no two runs are bitwise equal (two runs of 20
    # steps each ended 0.0106 apart at step 21 on an H200), and the bound there is
    # the drift's.
    assert abs(resumed[21] - straight[21]) < 1e-3, (resumed[21], straight[21])
    for step in (30, 40):
        assert abs(resumed[step] - straight[step]) < 3e-2, (step, resumed[step], straight[step])
    te_trainer, te_losses = fit(tmp_path / "te", tokens, 30, FP8Precision(), backend="te",
                                ckpt_path=at20)
    assert te_trainer.precision_plugin.fp8_active and te_trainer.precision_plugin.engine.name == "te"
    assert abs(te_losses[21] - straight[21]) < 0.05, (te_losses[21], straight[21])


def test_torchao_fsdp2_float8_all_gather_trains_resumes_and_consolidates_into_te(tmp_path,
                                                                                 tokens):
    """``FSDP2Strategy(float8_all_gather=True)`` over one GPU (FSDP2's all-gather hooks run with a
    world of one): the GEMMs receive float8 weights, the curve is that of BF16 gathers, the
    sharded checkpoint resumes the curve and consolidates into a file TE FP8 trains on. Eager,
    as FSDP2 runs on several GPUs by default (model.compile off there)."""
    import lightning as L
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    from fp8_lightning.commands.checkpoints import consolidate
    from fp8_lightning.distributed import FSDP2Strategy
    from tests.test_gpu import fit

    class Gathered(L.Callback):  # the weight types the first block's MLP receives in forward
        def __init__(self):
            self.types = set()

        def on_train_start(self, trainer, module):
            module.model.blocks[0].mlp.register_forward_pre_hook(
                lambda m, args: self.types.add(type(m.fc1_weight)))

    def run(path, steps, float8_all_gather, **kwargs):
        return fit(tmp_path / path, tokens, steps,
                   FP8Precision(recipe="tensorwise", fp8_layers="all"),
                   strategy=FSDP2Strategy(float8_all_gather=float8_all_gather), compile=False,
                   **kwargs)

    _, bf16_gathers = run("bf16", 20, False)
    gathered = Gathered()
    trainer, straight = run("f8", 40, True, save_at=20, callbacks=[gathered])
    assert trainer.precision_plugin.fp8_active and gathered.types == {Float8TrainingTensor}
    gaps = [abs(straight[s] - bf16_gathers[s]) / bf16_gathers[s] for s in range(1, 21)]
    print(f"\n[float8 all-gather] loss at 20: {straight[20]:.4f} (BF16 gathers "
          f"{bf16_gathers[20]:.4f}), relative gaps {[round(g, 4) for g in gaps]}")
    # The GEMMs see the same float8 weights up to the order of two roundings (float32 -> float8
    # against float32 -> BF16 -> float8): equal curves at first, then drifting apart as any two
    # roundings of a steep descent do (an H200 measured 1e-4 for steps 1-4, 2.5% at step 20).
    # A stale or wrong scale shows from the first steps.
    assert max(gaps[:4]) < 1e-3 and max(gaps) < 0.05
    at20 = tmp_path / "f8" / "at20.ckpt"
    assert at20.is_dir()  # FSDP2's sharded checkpoint
    _, resumed = run("resumed", 40, True, ckpt_path=at20)
    assert abs(resumed[21] - straight[21]) < 2e-3, (resumed[21], straight[21])
    for step in (30, 40):
        assert abs(resumed[step] - straight[step]) < 3e-2, (step, resumed[step], straight[step])
    one = consolidate(str(at20), str(tmp_path / "one.ckpt"))
    state = torch.load(one, weights_only=True)["state_dict"]  # plain tensors, no torchao class
    assert all(type(v) is torch.Tensor for v in state.values())
    te_trainer, te_losses = fit(tmp_path / "te", tokens, 30, FP8Precision(), backend="te",
                                ckpt_path=one)
    assert te_trainer.precision_plugin.engine.name == "te" and te_trainer.precision_plugin.fp8_active
    assert abs(te_losses[21] - straight[21]) < 0.05, (te_losses[21], straight[21])
