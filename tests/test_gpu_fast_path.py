"""GPU tests of the fast path (compiled regions, CUDA graphs, fit == bench).

`python -m pytest -m gpu tests/test_gpu_fast_path.py -s` on the GPU machine (they skip without
CUDA/TE). GPT-2 124M on the embedded corpus, FP8 delayed scaling.
"""

import lightning as L
import pytest
import torch

from fp8_lightning.measure import measure, parse_variant
from fp8_lightning.config import GPTConfig
from fp8_lightning.data.streaming import EMBEDDED_CORPUS
from fp8_lightning.fp8 import FP8Precision
from fp8_lightning.module import GPTLightningModule
from fp8_lightning.callbacks.guard import NaNGuard
from fp8_lightning.callbacks.monitor import TrainingMonitor
from fp8_lightning.tokenizer import get_tokenizer

from tests.helpers import StepTimer

pytestmark = pytest.mark.gpu

B, T = 8, 1024


@pytest.fixture(scope="module")
def blocks():
    ids = torch.tensor(get_tokenizer("gpt2").encode(EMBEDDED_CORPUS.read_text()))
    n = ids.numel() // (T + 1)
    return ids[: n * (T + 1)].view(n, T + 1)


class Losses(L.Callback):
    def __init__(self):
        self.losses = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = outputs["loss"]  # a tensor: no sync per step


def fit(tmp_path, blocks, steps, callbacks=(), ckpt_path=None, n_layer=12, skip_batches=0,
        accumulate_grad_batches=1, batch_size=B, recipe="delayed", strategy="auto", **module_args):
    L.seed_everything(0)
    module = GPTLightningModule(config=GPTConfig(name="gpt2", n_layer=n_layer),
                                warmup_steps=10, lr_decay_steps=200, **module_args)
    # skip_batches: a resumed run's plain DataLoader restarts its epoch; starting it where the
    # checkpoint left off gives it the batches the uninterrupted run saw
    data = blocks.repeat(4, 1)[skip_batches * batch_size:]
    # Pinned, as fp8_lightning's data modules load: a pageable host->device copy waits for the
    # stream to drain, a sync per step that no user's fit has.
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False, drop_last=True,
                                         pin_memory=True)
    losses = Losses()
    trainer = L.Trainer(
        max_steps=steps, plugins=[FP8Precision(recipe=recipe)], accelerator="gpu", devices=1,
        strategy=strategy, use_distributed_sampler=False,  # the same batches under FSDP2 too
        logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, limit_val_batches=0, gradient_clip_val=1.0,
        accumulate_grad_batches=accumulate_grad_batches, default_root_dir=tmp_path, callbacks=[losses, *callbacks])
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer, {k: float(v) for k, v in losses.losses.items()}


def test_compiled_and_eager_fp8_agree_over_50_steps(tmp_path, blocks):
    _, eager = fit(tmp_path / "eager", blocks, 50, n_layer=4, compile=False, cuda_graphs=False)
    trainer, compiled = fit(tmp_path / "compiled", blocks, 50, n_layer=4, compile=True,
                            cuda_graphs=False)
    assert trainer.lightning_module.compiled and trainer.precision_plugin.fp8_active
    diffs = [abs(compiled[s] - eager[s]) for s in eager]
    print(f"\n[compiled vs eager FP8] loss at 50: {compiled[50]:.4f} vs {eager[50]:.4f}, "
          f"max |diff| {max(diffs):.4f}")
    assert eager[50] < eager[1] - 2  # it learns
    assert abs(compiled[50] - eager[50]) < 0.02 * eager[50]
    assert sum(diffs) / len(diffs) < 0.05


def test_cuda_graph_path_trains_checkpoints_and_resumes(tmp_path, blocks):
    trainer, full = fit(tmp_path / "full", blocks, 40, n_layer=4)
    assert trainer.lightning_module.graphed == "FP8"
    assert trainer.precision_plugin.fp8_active
    trainer, first = fit(tmp_path / "first", blocks, 20, n_layer=4)
    ckpt = tmp_path / "at20.ckpt"
    trainer.save_checkpoint(ckpt)
    trainer, resumed = fit(tmp_path / "resumed", blocks, 40, n_layer=4, skip_batches=20,
                           ckpt_path=str(ckpt))
    assert trainer.lightning_module.graphed == "FP8"
    assert trainer.precision_plugin.scaling_restored > 0
    print(f"\n[graphs resume] loss at 40: uninterrupted {full[40]:.4f}, resumed {resumed[40]:.4f}")
    assert full[40] < full[1] - 2
    # The same curve (the embedding's atomic adds make no two runs bitwise equal); a resume that
    # lost weights, optimizer state or FP8 scales would be far off.
    worst = max(abs(resumed[s] - full[s]) / full[s] for s in range(21, 41))
    print(f"[graphs resume] worst relative gap over steps 21..40: {worst:.4f}")
    assert worst < 0.02
    assert all(abs(first[s] - full[s]) < 0.02 * full[s] for s in range(1, 21))


def test_a_second_fit_of_the_same_module_captures_its_own_graphs(tmp_path, blocks):
    """A notebook's fits of one module: Lightning moves the module to the CPU after each fit,
    so the next fit's parameters live elsewhere and a graph of the last fit would replay stale
    addresses. Each fit frees the last one's graphs and captures its own, under its own recipe
    (delayed, then current twice): the memory held after the third fit is the second's."""
    import gc

    L.seed_everything(0)
    module = GPTLightningModule(config=GPTConfig(name="gpt2", n_layer=4), warmup_steps=5,
                                lr_decay_steps=200)
    loader = torch.utils.data.DataLoader(blocks, batch_size=B, drop_last=True, pin_memory=True)
    recipes, held, losses, trained = [], [], [], []
    for recipe in ("delayed", "current", "current"):
        # (the model is built at the first fit's configure_model)
        before = module.model and [p.detach().cpu().clone() for p in module.model.blocks.parameters()]
        seen = Losses()
        trainer = L.Trainer(max_steps=10, plugins=[FP8Precision(recipe=recipe)],
                            accelerator="gpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_checkpointing=False, enable_model_summary=False,
                            limit_val_batches=0, default_root_dir=tmp_path, callbacks=[seen])
        trainer.fit(module, loader)
        assert module.graphed == "FP8", recipe
        recipes.append(type(module._runner.block_graphs.recipe).__name__)
        losses.append([float(seen.losses[s]) for s in (1, 10)])
        if before:
            trained.append(all(not torch.equal(a, p.detach().cpu())
                               for a, p in zip(before, module.model.blocks.parameters())))
        del trainer
        gc.collect()
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated())
    print(f"\n[fits of one module] losses at steps 1 and 10: {losses}; GPU memory held: {held}")
    assert recipes == ["DelayedScaling", "Float8CurrentScaling", "Float8CurrentScaling"]
    # each fit goes on from the last one's weights and trains every block's parameters: a graph
    # of the last fit would replay freed storage, and its gradients would not reach them (each
    # fit starts a fresh AdamW and warm-up, so a later fit's loss may rise a little at first)
    assert losses[0][1] < losses[0][0] - 2 and all(later[0] < losses[0][0] - 2
                                                   for later in losses[1:]), losses
    assert trained == [True, True]
    assert held[2] < held[1] * 1.02 + 2**24  # the last graphs' memory pool was freed


@pytest.mark.parametrize("accumulate", [1, 2])
def test_graphs_train_as_eager_blocks_do(tmp_path, blocks, accumulate):
    # Without accumulation the gradients are the graphs' static buffers (no clone); with it they
    # are cloned. Either way the curve is the eager blocks' (a gradient overwritten by the next
    # replay, or accumulated twice, would show within a few steps).
    _, eager = fit(tmp_path / "eager", blocks, 20, n_layer=4, cuda_graphs=False,
                   accumulate_grad_batches=accumulate)
    trainer, graphed = fit(tmp_path / "graphs", blocks, 20, n_layer=4,
                           accumulate_grad_batches=accumulate)
    assert trainer.lightning_module.graphed == "FP8"
    worst = max(abs(graphed[s] - eager[s]) / eager[s] for s in eager)
    print(f"\n[graphs vs eager, accumulate {accumulate}] loss at 20: {graphed[20]:.4f} vs "
          f"{eager[20]:.4f}, worst relative gap {worst:.4f}")
    assert eager[20] < eager[1] - 1 and worst < 0.02


def test_graphs_step_aside_for_bf16_fallback_and_return(tmp_path, blocks):
    class FallBack(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            plugin = trainer.precision_plugin
            if trainer.global_step == 10:
                plugin.disable_fp8("test", step=10)
            if trainer.global_step == 20:
                plugin.enable_fp8(step=20)

    trainer, losses = fit(tmp_path, blocks, 30, n_layer=4, callbacks=[FallBack()])
    assert trainer.precision_plugin.fp8_active and trainer.lightning_module.graphed == "FP8"
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values()) and losses[30] < losses[1]


class ValLosses(L.Callback):
    def __init__(self):
        self.losses = {}

    def on_validation_end(self, trainer, module):
        self.losses[trainer.global_step] = float(trainer.callback_metrics["val/loss"])


@pytest.mark.parametrize("accumulate", [1, 2])
def test_te_fp8_under_fsdp2_replays_the_step_and_validates_the_stepped_weights(tmp_path, blocks,
                                                                                caplog, accumulate):
    """FSDP2 over one GPU with the defaults: the loss compiled, the step's forward and backward
    (FSDP2's gathers and reductions with it) one CUDA graph. The curve is the eager step's under
    the same sharding, and the validations between replays (steps 10, 20) measure the weights as
    stepped: an eager forward leaves the root's weights gathered, which the next replays do not
    update, and a validation that used them would read step 10's embedding at step 20."""
    from fp8_lightning.distributed import FSDP2Strategy

    runs = {}
    for name, graphs in (("eager", False), ("graphs", None)):
        L.seed_everything(0)
        module = GPTLightningModule(config=GPTConfig(name="gpt2", n_layer=4), warmup_steps=10,
                                    lr_decay_steps=200, cuda_graphs=graphs)
        loader = torch.utils.data.DataLoader(blocks.repeat(4, 1), batch_size=B, drop_last=True,
                                             pin_memory=True)
        val = torch.utils.data.DataLoader(blocks[:2 * B], batch_size=B, pin_memory=True)
        losses, vals = Losses(), ValLosses()
        trainer = L.Trainer(max_steps=20, plugins=[FP8Precision()], accelerator="gpu", devices=1,
                            strategy=FSDP2Strategy(), use_distributed_sampler=False, logger=False,
                            enable_progress_bar=False, enable_checkpointing=False,
                            enable_model_summary=False, val_check_interval=10 * accumulate,
                            num_sanity_val_steps=0, gradient_clip_val=1.0,
                            accumulate_grad_batches=accumulate, default_root_dir=tmp_path / name,
                            callbacks=[losses, vals])
        with caplog.at_level("INFO"):
            trainer.fit(module, loader, val)
        runs[name] = module, {k: float(v) for k, v in losses.losses.items()}, vals.losses
    (module, graphed, graphed_val), (_, eager, eager_val) = runs["graphs"], runs["eager"]
    assert module.compiled == "the loss" and module.graphed == "FP8"
    assert "CUDA graphs: on, the step's forward and backward as one graph" in caplog.text
    assert "the step's forward and backward captured for micro-batch 8x1024 (FP8)" in caplog.text
    worst = max(abs(graphed[s] - eager[s]) / eager[s] for s in eager)
    print(f"\n[FSDP2 one GPU, accumulate {accumulate}] loss at 20: {graphed[20]:.4f} vs eager "
          f"{eager[20]:.4f}, worst relative gap {worst:.4f}; validation {graphed_val} vs "
          f"{eager_val}")
    # (equal bitwise with and without accumulation; the stale weights this guards against put
    # them 15% apart, and a replay adding into gradients Lightning dropped before a validation,
    # 0.7% to 20%)
    assert graphed[20] < graphed[1] - 1 and worst < 0.005
    assert sorted(graphed_val) == sorted(eager_val) == [10, 20]
    assert all(abs(graphed_val[s] - eager_val[s]) < 0.001 * eager_val[s] for s in eager_val)


def test_fsdp2_builds_the_model_on_the_gpu_unless_it_would_crowd_it():
    """Lightning's ModelParallelStrategy builds on the CPU (about two minutes for Llama-3-8B under
    torchrun); FSDP2Strategy builds on the GPU, where the whole model waits for fully_shard,
    unless its fp32 parameters would take more than half the free memory."""
    from tests.test_fsdp2 import built_on

    assert built_on("cuda:0", GPTConfig.from_name("gpt2")) == "cuda"
    assert built_on("cuda:0", GPTConfig.from_name("llama3-8b", n_layer=800)) == "cpu"  # ~100B


@pytest.mark.parametrize("recipe, batch_size", [("delayed", 8), ("delayed", 16),
                                               ("tensorwise", 16)])  # TE, and torchao's graphs
def test_short_fit_within_3_percent_of_bench(tmp_path, blocks, recipe, batch_size):
    """fit's loop (data loader, NaNGuard, TrainingMonitor, Lightning's hooks) against bench's
    step of the same variant and micro-batch, in one process."""
    # From step 55: NaNGuard's first weight snapshot (step 50: ~1.4 s, it allocates pinned host
    # memory; then one per 500 steps) is a one-off, not the loop's speed.
    timer = StepTimer(55)
    fit(tmp_path, blocks, 115, callbacks=[timer, NaNGuard(), TrainingMonitor(
        log_every=10, sample_prompt=None, console=False)], batch_size=batch_size, recipe=recipe)
    bench = measure(parse_variant(f"fp8-{recipe}"), GPTConfig(name="gpt2"), batch_size, T,
                    steps=30, warmup=5, device=torch.device("cuda"),
                    module_class=GPTLightningModule,
                    fp8_args=dict(recipe=recipe, weights="bf16-mixed", on_unavailable="error"))
    print(f"\n[fit vs bench] GPT-2 124M FP8 {recipe} {batch_size}x{T} on "
          f"{torch.cuda.get_device_name()}: "
          f"fit {timer.ms:.2f} ms/step, bench {bench['ms_per_step']:.2f} ms/step "
          f"(host {bench['host_ms']}), ratio {bench['ms_per_step'] / timer.ms:.3f}")
    assert bench["ms_per_step"] / timer.ms >= 0.97
