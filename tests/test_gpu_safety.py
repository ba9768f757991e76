"""GPU: the NaN guard on real TransformerEngine FP8 (`pytest -m gpu -s` on the GPU machine)."""

import lightning as L
import pytest
import torch

from fp8_lightning import FaultInjection, FP8Precision, NaNGuard
from fp8_lightning.config import GPTConfig
from fp8_lightning.module import GPTLightningModule

pytestmark = pytest.mark.gpu


class Losses(L.Callback):
    def __init__(self):
        self.values = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.values[trainer.global_step] = outputs["loss"].item()


def synthetic(n, seq, vocab=50257, seed=0):
    g = torch.Generator().manual_seed(seed)
    # A learnable stream (a repeating pattern with noise) so the loss has somewhere to go.
    base = torch.randint(0, vocab, (64,), generator=g)
    rows = [torch.roll(base, int(s)).repeat(seq // 64 + 2)[: seq + 1]
            for s in torch.randint(0, 64, (n,), generator=g)]
    return torch.stack(rows)


def trainer_for(steps, callbacks, plugin, log_every=5, **kwargs):
    return L.Trainer(max_steps=steps, plugins=[plugin], accelerator="gpu", devices=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                     enable_checkpointing=False, callbacks=callbacks, gradient_clip_val=1.0,
                     log_every_n_steps=log_every, **kwargs)


def test_real_fp8_divergence_falls_back_recovers_and_reenables_fp8(capsys):
    """An absurd learning rate for one step (x1e39) blows the TE FP8 model up for real."""
    L.seed_everything(0)
    config = GPTConfig.from_name("gpt2", n_layer=4, n_head=4, n_embd=256, ffn_hidden=1024,
                                 block_size=128)
    module = GPTLightningModule(config=config, learning_rate=1e-3, warmup_steps=5,
                                lr_decay_steps=1000)
    plugin = FP8Precision(recipe="delayed")
    guard = NaNGuard(max_bad_steps=2, window=20, bf16_steps=20, check_every=5, snapshot_every=5)
    losses = Losses()
    trainer = trainer_for(90, [FaultInjection(steps=[32], kind="lr", lr_factor=1e39), guard,
                               losses], plugin)
    loader = torch.utils.data.DataLoader(synthetic(90 * 8, 128), batch_size=8)
    trainer.fit(module, loader)
    kinds = [e["event"] for e in guard.events]
    assert "skipped" in kinds and "rollback" in kinds and "bf16_fallback" in kinds, guard.events
    assert kinds[-1] == "fp8_reenabled" and plugin.fp8_active
    rollback = next(e for e in guard.events if e["event"] == "rollback")
    assert "in-memory snapshot" in rollback["detail"]
    assert [h["event"] for h in plugin.history][-2:] == ["disabled", "enabled"]
    before, end = losses.values[30], losses.values[90]
    assert torch.isfinite(torch.tensor(end)) and end < before, (before, end)
    assert all(torch.isfinite(p).all() for p in module.parameters())
    with capsys.disabled():
        print(f"\n[guard recovery] events: {[(e['event'], e['step']) for e in guard.events]}")
        print("[guard recovery] loss @30 (before) %.4f | @33 %s | @%d (rollback) %s | @90 (FP8 "
              "again) %.4f" % (before, losses.values.get(33), rollback["step"],
                               losses.values.get(rollback["step"]), end))
