"""GPTLightningModule's training step: compiled or eager, the same losses (bench builds this
step: tests/test_measure.py)."""

import lightning as L
import pytest
import torch

from fp8_lightning import fast_path_runner, module as module_lib
from fp8_lightning.config import GPTConfig
from fp8_lightning.module import GPTLightningModule

CONFIG = dict(name="tiny", vocab_size=512)  # the quickstart model, a small vocabulary


class Losses(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def fit(steps, **module_args):
    L.seed_everything(0)
    module = GPTLightningModule(GPTConfig(**CONFIG), backend="torch", warmup_steps=2,
                                learning_rate=3e-3, **module_args)
    starts = torch.randint(0, 512, (8 * steps, 1), generator=torch.Generator().manual_seed(1))
    data = (starts + 7 * torch.arange(65)) % 512  # each next token is learnable: previous + 7
    losses = Losses()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=[losses], gradient_clip_val=1.0)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    return module, losses.losses


def test_compiled_training_has_the_eager_losses():
    eager_module, eager = fit(6, compile=False)
    assert eager_module.compiled is None  # and off by default on a CPU: see the next test
    module, compiled = fit(6, compile=True)
    assert module.compiled == "the whole model and its loss, one graph"
    assert [n for n, _ in module.named_parameters()] == \
        [n for n, _ in eager_module.named_parameters()]  # no _orig_mod. prefix
    assert compiled[-1] < compiled[0]
    assert compiled == pytest.approx(eager, rel=2e-3)
    torch._dynamo.reset()


def test_compile_is_off_by_default_on_a_cpu():
    module = GPTLightningModule(GPTConfig(**CONFIG), backend="torch")
    module.configure_model()
    assert module.compiled is None


def test_a_failing_compilation_falls_back_to_eager_with_the_reason(monkeypatch):
    def broken_backend(gm, example_inputs):
        raise RuntimeError("no C++ compiler here")

    def compile_broken(model, **_):  # compile_model's keywords (regions) do not matter here
        model.compile(backend=broken_backend)
        return "the whole model (a backend that fails)"

    monkeypatch.setattr(fast_path_runner, "compile_model", compile_broken)
    with pytest.warns(UserWarning, match=r"torch.compile failed .*no C\+\+ compiler here.*training eagerly"):
        module, losses = fit(3, compile=True)
    assert module.compiled is None and len(losses) == 3 and all(map(torch.isfinite, map(torch.tensor, losses)))
    torch._dynamo.reset()


@pytest.mark.parametrize("max_norm", [1e-3, 1e3])  # clipped, and left as it is
def test_the_clip_folded_into_fused_adamw_is_the_separate_clip(max_norm):
    """configure_gradient_clipping hands the clip to the fused AdamW as its ``grad_scale``: the
    parameters after the step and the gradients it leaves are those of clip_grads_with_norm_
    followed by the same step; without a clip the scale is cleared again."""
    results = []
    for fold in (True, False):
        torch.manual_seed(0)
        module = GPTLightningModule(GPTConfig(**CONFIG), backend="torch", lr_decay_steps=10)
        module.configure_model()
        optimizer = module.configure_optimizers()["optimizer"]
        idx = torch.randint(0, 512, (2, 17))
        module.loss(idx)[0].backward()
        module.on_after_backward()
        if fold:
            module.configure_gradient_clipping(optimizer, max_norm, "norm")
            assert optimizer.grad_scale is not None
        else:
            assert module_lib.takes_grad_scale(optimizer, module.parameters())
            torch.nn.utils.clip_grads_with_norm_(module.parameters(), max_norm, module.grad_norm)
        optimizer.step()
        results.append([t.detach().clone() for p in module.parameters() for t in (p, p.grad)])
        module.configure_gradient_clipping(optimizer, None)
        assert optimizer.grad_scale is None
    for folded, separate in zip(*results):
        torch.testing.assert_close(folded, separate, rtol=1e-5, atol=1e-7)


class NormCheck(L.Callback):
    """Before each optimizer step: the norm the clip and the NaN guard read against the norm of
    the gradients the module's parameters hold now."""

    def __init__(self):
        self.pairs = []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        self.pairs.append((float(module.grad_norm), float(torch.nn.utils.get_total_norm(grads))))


def test_the_gradient_norm_is_this_steps_in_every_run_of_the_module():
    """The module looks its parameters up once per run (not per step): a second fit of the same
    module whose parameters were replaced in between (as a strategy's setup does) reads the new
    ones, never the first run's."""
    torch.manual_seed(0)
    module = GPTLightningModule(GPTConfig(**CONFIG), backend="torch", warmup_steps=1)
    data = torch.randint(0, 512, (16, 17), generator=torch.Generator().manual_seed(0))
    checks = []
    for run in range(2):
        if run:
            module.model = None  # configure_model builds a new model: new parameter objects
        check = NormCheck()
        trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False,
                            enable_progress_bar=False, enable_checkpointing=False,
                            enable_model_summary=False, callbacks=[check], gradient_clip_val=1.0)
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
        checks.append(check.pairs)
    for pairs in checks:
        assert len(pairs) == 2
        for read, actual in pairs:
            assert read == pytest.approx(actual, rel=1e-6) and actual > 0


class GradsAtForward(L.Callback):
    """Whether any parameter holds a gradient when each batch's forward starts."""

    def __init__(self):
        self.held = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.held.append(any(p.grad is not None for p in module.parameters()))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_no_gradient_outlives_its_optimizer_step_into_the_next_forward(accumulate):
    """The gradients are dropped after the optimizer step, not (as Lightning does) after the
    next step's forward, where they would sit beside its activations (the memory estimate's
    peak: the larger of the two, not their sum); an accumulated step keeps them between its
    micro-batches."""
    torch.manual_seed(0)
    module = GPTLightningModule(GPTConfig(**CONFIG), backend="torch", warmup_steps=1)
    data = torch.randint(0, 512, (24, 17), generator=torch.Generator().manual_seed(0))
    check = GradsAtForward()
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=[check], gradient_clip_val=1.0,
                        accumulate_grad_batches=accumulate)
    module.configure_model()  # (fit keeps a model already built)
    before = [p.detach().clone() for p in module.parameters()]
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    assert trainer.global_step == 3
    after = list(module.parameters())
    assert len(before) == len(after) > 0  # it trained:
    assert all(not torch.equal(a, p) for a, p in zip(before, after))
    # a step's first micro-batch finds none; the second of an accumulated step finds the first's
    assert check.held == ([False] * 3 if accumulate == 1 else [False, True] * 3)


def test_the_memory_check_sees_the_runs_precision_accumulation_compile_and_checkpointing():
    """What the memory check estimates for (fp8_lightning/memory.py): read from the Trainer,
    the FP8 plugin and the data module as a fit configures them."""
    from fp8_lightning.data.streaming import TokenShardDataModule
    from fp8_lightning.fp8 import FP8Precision

    data = TokenShardDataModule(batch_size=4, seq_len=64)
    module = GPTLightningModule(config=GPTConfig.from_name("tiny", n_layer=4), backend="torch",
                                activation_checkpointing="mlp", activation_checkpointing_every=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, accumulate_grad_batches=3,
                        plugins=[FP8Precision(weights="bf16-true", on_unavailable="fallback")])
    run = module.memory_run(trainer, data)
    assert (run.batch_size, run.seq_len, run.shards, run.accumulate_grad_batches) == (4, 64, 1, 3)
    assert run.master_bytes == 2 and not run.fp8  # bf16-true weights; the torch backend
    assert (run.activation_checkpointing, run.activation_checkpointing_every) == ("mlp", 2)
    assert run.fp32_residual and not run.compiled_loss  # the torch backend; no compile on a CPU
    default = module.memory_run(L.Trainer(accelerator="cpu", devices=1, logger=False), data)
    assert default.master_bytes == 4 and default.accumulate_grad_batches == 1
    assert module.memory_run(trainer, None) is None  # a plain DataLoader: not known in advance


def test_train_loss_is_logged_on_the_loggers_steps_and_the_last(tmp_path):
    """``self.log`` costs host time every step; the loss is logged only where Lightning writes
    it (every log_every_n_steps) and on the last step, so callback_metrics ends on the last
    step's loss."""
    L.seed_everything(0)
    module = GPTLightningModule(GPTConfig(**CONFIG), backend="torch", warmup_steps=2)
    logged, losses = [], Losses()
    log = module.log
    module.log = lambda name, *a, **k: (logged.append((module.trainer.global_step + 1, name)),
                                        log(name, *a, **k))
    data = torch.randint(0, 512, (8 * 7, 65))
    trainer = L.Trainer(max_steps=7, accelerator="cpu", devices=1, log_every_n_steps=3,
                        logger=L.pytorch.loggers.CSVLogger(tmp_path, name="", version=""),
                        enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=[losses])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    assert [s for s, name in logged if name == "train/loss"] == [3, 6, 7]
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    written = [int(r.split(",")[header.index("step")]) for r in rows[1:]
               if r.split(",")[header.index("train/loss")]]
    assert written == [2, 5]  # Lightning's 0-based step index: steps 3 and 6
    assert float(trainer.callback_metrics["train/loss"]) == pytest.approx(losses.losses[-1])
