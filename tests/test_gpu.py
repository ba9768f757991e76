"""GPU tests: real TransformerEngine on an FP8-capable GPU (`pytest -m gpu` on the GPU machine).

They skip cleanly without CUDA/TE (see conftest.py).
"""

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from fp8_lightning.config import GPTConfig
from fp8_lightning.fp8 import FP8Precision
from fp8_lightning.fp8.te_engine import fp8_modules_ran, te_gemm_modules
from fp8_lightning.model import GPT
from fp8_lightning.module import GPTLightningModule
from fp8_lightning.tokenizer import get_tokenizer
from fp8_lightning.data.streaming import EMBEDDED_CORPUS

from tests.helpers import GPU_B, GPU_SMALL, GPU_T

pytestmark = pytest.mark.gpu

SMALL, B, T = GPU_SMALL, GPU_B, GPU_T


@pytest.fixture(scope="module")
def tokens():
    """Real text: the embedded corpus as (N, T+1) blocks."""
    ids = torch.tensor(get_tokenizer("gpt2").encode(EMBEDDED_CORPUS.read_text()[:400_000]))
    n = ids.numel() // (T + 1)
    return ids[: n * (T + 1)].view(n, T + 1)


def loss_of(model, batch):
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def make_model(backend="te", seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(GPTConfig.from_name("gpt2", **{**SMALL, **overrides}), backend=backend).cuda()


def train(model, plugin, tokens, steps, lr=1e-3, start=0):
    """A plain loop through the plugin's contexts (forward in the FP8 region, backward outside)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    losses = []
    for step in range(start, start + steps):
        batch = tokens[(step * B) % (len(tokens) - B):][:B].cuda()
        with plugin.train_step_context():
            loss = loss_of(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def eval_loss(model, tokens):
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        return loss_of(model, tokens[-B:].cuda()).item()


def test_te_backend_trains_in_bf16(tokens):
    model = make_model()
    assert te_gemm_modules(model)
    plugin = FP8Precision()
    plugin.convert_module(model)
    plugin.disable_fp8("BF16 baseline for this test")
    losses = train(model, plugin, tokens, 30)
    assert losses[-1] < losses[0] - 1.0, losses
    assert not fp8_modules_ran(model)


def test_te_and_torch_agree_on_logits_and_checkpoints_cross_load(tokens):
    te_model = make_model("te").eval()
    torch_model = make_model("torch", seed=1).eval()
    assert set(te_model.state_dict()) == set(torch_model.state_dict())
    torch_model.load_state_dict(te_model.state_dict(), strict=True)
    batch = tokens[:2, :-1].cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        a, b = te_model(batch).float(), torch_model(batch).float()
    assert (a - b).abs().max().item() < 0.1 and torch.allclose(a, b, atol=0.1, rtol=0.05)
    # ... and back: torch -> te
    back = make_model("te", seed=2)
    back.load_state_dict(torch_model.state_dict(), strict=True)
    for k, v in te_model.state_dict().items():
        if not k.endswith("_extra_state"):
            torch.testing.assert_close(back.state_dict()[k], v)


@pytest.mark.parametrize("extra", [{}, {"qkv_bias": True, "head_size": 32, "qk_norm": False,
                                       "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                        "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 16}}],
                         ids=["llama3", "qwen2-style-wide-heads-llama3.1-rope"])
def test_llama_family_on_te_matches_torch(extra):
    cfg = dict(name="tiny-llama", n_embd=128, n_head=8, n_kv_heads=2, ffn_hidden=256, **extra)
    torch.manual_seed(0)
    te_model = GPT(GPTConfig(**cfg), backend="te").cuda().eval()
    torch_model = GPT(GPTConfig(**cfg), backend="torch").cuda().eval()
    torch_model.load_state_dict(te_model.state_dict(), strict=True)
    idx = torch.randint(0, 1000, (2, 64), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        torch.testing.assert_close(te_model(idx).float(), torch_model(idx).float(), atol=0.1, rtol=0.05)


@pytest.fixture(scope="module")
def bf16_reference(tokens):
    model = make_model()
    plugin = FP8Precision()
    plugin.convert_module(model)
    plugin.disable_fp8("BF16 reference")
    losses = train(model, plugin, tokens, 100)
    return losses, eval_loss(model, tokens)


@pytest.mark.parametrize("recipe", ["current", "block"])
def test_stateless_recipes_checkpoint_without_scaling_state(recipe, tokens):
    model = make_model()
    plugin = FP8Precision(recipe=recipe)
    plugin.convert_module(model)
    train(model, plugin, tokens, 2)
    state = plugin.state_dict()
    assert state["effective_precision"] == f"fp8-{recipe}" and "scaling" not in state
    assert all(v.numel() == 0 for k, v in model.state_dict().items() if k.endswith("_extra_state"))


@pytest.mark.parametrize("recipe", ["delayed", "current", "block"])
def test_recipe_trains_100_steps_close_to_bf16(recipe, tokens, bf16_reference, capsys):
    model = make_model()
    plugin = FP8Precision(recipe=recipe)
    plugin.convert_module(model)
    assert plugin.fp8_active, plugin.reason
    losses = train(model, plugin, tokens, 100)
    assert all(torch.isfinite(torch.tensor(losses)))
    ran = fp8_modules_ran(model)
    assert plugin.fp8_active and ran, "no module ran FP8"
    assert "lm_head" not in ran  # fp8_lm_head defaults to false
    final = eval_loss(model, tokens)
    ref_losses, ref_final = bf16_reference
    gap = abs(final - ref_final) / ref_final
    with capsys.disabled():
        print(f"\n[step-100] recipe={recipe}: train loss {losses[-1]:.4f} (bf16 {ref_losses[-1]:.4f}), "
              f"eval loss {final:.4f} (bf16 {ref_final:.4f}), gap {100 * gap:.2f}%")
    assert gap < 0.02


def test_fp8_kernels_execute(tokens, capsys):
    model = make_model()
    plugin = FP8Precision(recipe="delayed")
    plugin.convert_module(model)
    train(model, plugin, tokens, 2)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        train(model, plugin, tokens, 1)
    names = {e.key for e in prof.key_averages()}
    fp8_names = sorted(n for n in names if any(s in n.lower() for s in
                                               ("fp8", "e4m3", "float8", "quantize", "cast_transpose")))
    with capsys.disabled():
        print(f"\n[fp8 kernels] {len(fp8_names)} of {len(names)}: {fp8_names[:6]}")
    assert fp8_names


def test_layer_policy_really_keeps_edges_and_head_bf16(tokens):
    model = make_model()
    plugin = FP8Precision(bf16_first_layers=1, bf16_last_layers=1)
    plugin.convert_module(model)
    train(model, plugin, tokens, 2)
    ran = set(fp8_modules_ran(model))
    gemms = set(te_gemm_modules(model))
    bf16 = {n for n in gemms if n.startswith(("blocks.0.", "blocks.3.")) or n == "lm_head"}
    assert bf16 and not (ran & bf16)
    assert ran == gemms - bf16


def test_validation_runs_bf16_unless_fp8_eval(tokens):
    model = make_model()
    plugin = FP8Precision()
    plugin.convert_module(model)
    train(model, plugin, tokens, 2)
    with torch.no_grad(), plugin.val_step_context():
        loss_of(model, tokens[:B].cuda())
    assert not fp8_modules_ran(model)
    plugin.fp8_eval = True
    with torch.no_grad(), plugin.val_step_context():
        loss_of(model, tokens[:B].cuda())
    assert fp8_modules_ran(model)


# ------------------------------------------------------------------ resume through the Trainer
class Losses(L.Callback):
    """Each step's loss, and the learning rate that step ran with."""

    def __init__(self):
        self.values, self.lrs = {}, {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.values[trainer.global_step] = outputs["loss"].item()
        self.lrs[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]


def lrs(trainer):
    return next(c for c in trainer.callbacks if isinstance(c, Losses)).lrs


def adam_steps(trainer):
    """The optimizer's step count per parameter (Adam keeps one per tensor)."""
    return {int(s["step"]) for s in trainer.optimizers[0].state.values()}


class SaveAt(L.Callback):
    """Writes ``<dir>/at<step>.ckpt`` when the run reaches ``step``, and trains on."""

    def __init__(self, step, directory):
        self.step, self.directory = step, directory

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.directory / f"at{self.step}.ckpt")


def fit(tmp_path, tokens, steps, precision, ckpt_path=None, backend="auto", save_at=None,
        strategy="auto", callbacks=(), **module_args):
    L.seed_everything(0)
    module = GPTLightningModule(config=GPTConfig.from_name("gpt2", **SMALL), backend=backend,
                                learning_rate=1e-3, warmup_steps=5, lr_decay_steps=40,
                                **module_args)
    losses = Losses()
    plugins = [precision] if isinstance(precision, FP8Precision) else None
    trainer = L.Trainer(max_steps=steps, plugins=plugins,
                        precision=None if plugins else precision, accelerator="gpu", devices=1,
                        # the one batch every step under FSDP2 too (Lightning would put a
                        # shuffling DistributedSampler in, even for a world of one)
                        strategy=strategy, use_distributed_sampler=False, logger=False,
                        enable_progress_bar=False,
                        limit_val_batches=0, default_root_dir=tmp_path,
                        callbacks=[losses, *callbacks] + ([SaveAt(save_at, tmp_path)]
                                                          if save_at else []),
                        enable_checkpointing=True)
    # Every batch is the same batch: the loss curve then depends only on the training state
    # (weights, optimizer, schedule, FP8 scaling), not on where the loader resumes. A plain
    # DataLoader re-serves one batch after a resume from a post-fit checkpoint (loader resume
    # is the streaming loader's job, tested with the data module).
    loader = torch.utils.data.DataLoader(tokens[:B].repeat(20, 1), batch_size=B, shuffle=False)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    trainer.save_checkpoint(tmp_path / f"step{steps}.ckpt")
    return trainer, losses.values


def test_fp8_resume_continues_the_loss_curve(tmp_path, tokens):
    _, straight = fit(tmp_path / "a", tokens, 40, FP8Precision())
    trainer, _ = fit(tmp_path / "b", tokens, 20, FP8Precision())
    ckpt = torch.load(tmp_path / "b" / "step20.ckpt", weights_only=True)  # no pickle anywhere
    assert ckpt["fp8_lightning"]["precision"] == "fp8-delayed"
    scaling = ckpt["FP8Precision"]["scaling"]
    assert scaling and all(v["amax_history_fwd"].abs().sum() > 0 for v in scaling.values())
    assert all(v.numel() == 0 for k, v in ckpt["state_dict"].items() if k.endswith("_extra_state"))
    resumed_trainer, resumed = fit(tmp_path / "c", tokens, 40, FP8Precision(),
                                   ckpt_path=tmp_path / "b" / "step20.ckpt")
    assert resumed_trainer.precision_plugin.fp8_active
    assert resumed_trainer.precision_plugin.scaling_restored == len(scaling)
    for step in (21, 30, 40):
        assert abs(resumed[step] - straight[step]) < 1e-2, (step, resumed[step], straight[step])


def test_bf16_to_fp8_and_back_and_to_torch_backend(tmp_path, tokens):
    fit(tmp_path / "bf16", tokens, 20, "bf16-mixed")
    trainer, fp8_losses = fit(tmp_path / "fp8", tokens, 40, FP8Precision(),
                              ckpt_path=tmp_path / "bf16" / "step20.ckpt")
    assert trainer.precision_plugin.fp8_active and all(torch.isfinite(torch.tensor(list(fp8_losses.values()))))
    trainer, bf16_losses = fit(tmp_path / "back", tokens, 60, "bf16-mixed",
                               ckpt_path=tmp_path / "fp8" / "step40.ckpt")
    assert trainer.global_step == 60 and all(v < 12 for v in bf16_losses.values())
    trainer, torch_losses = fit(tmp_path / "torch", tokens, 60, "bf16-mixed", backend="torch",
                                ckpt_path=tmp_path / "fp8" / "step40.ckpt")
    assert trainer.global_step == 60
    assert abs(torch_losses[41] - bf16_losses[41]) < 0.05
