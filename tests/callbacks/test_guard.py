"""The NaN guard: skip on the device, roll back, BF16 window, FP8 re-enable, final error."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from fp8_lightning import Checkpoint, FaultInjection, NaNGuard, NonFiniteTrainingError
from fp8_lightning.checkpoint_files import load_checkpoint_file
from fp8_lightning.config import ConfigError, GPTConfig
from fp8_lightning.module import GPTLightningModule
from tests.helpers import PretendFP8Precision, Snapshots

# A small vocabulary: GPT-2's 50k one makes the LM head and its AdamW update most of a CPU step
# (and of every snapshot and checkpoint the guard takes), and the guard's policy is the same.
VOCAB = 512


def random_tokens(n=64, seq=64):
    g = torch.Generator().manual_seed(0)
    return DataLoader(torch.randint(0, VOCAB, (n, seq + 1), generator=g), batch_size=4)


def fit(callbacks, steps, plugins=None, precision=None, **trainer_kwargs):
    L.seed_everything(0)
    module = GPTLightningModule(GPTConfig(name="tiny", n_layer=1, vocab_size=VOCAB),
                                backend="torch", learning_rate=1e-3, warmup_steps=2)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=any(isinstance(c, Checkpoint) for c in callbacks),
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks, plugins=plugins, precision=precision,
                        gradient_clip_val=1.0, **trainer_kwargs)
    trainer.fit(module, train_dataloaders=random_tokens())
    return trainer, module


def events(guard):
    return [(e["event"], e["step"]) for e in guard.events]


def finite(module):
    return all(torch.isfinite(p).all() for p in module.parameters())


def test_non_finite_steps_are_skipped_on_the_device():
    guard = NaNGuard(max_bad_steps=3, check_every=2)
    trainer, module = fit([FaultInjection(steps=[3], kind="grad", value="inf"),
                           FaultInjection(steps=[5], kind="activation", value="nan"), guard],
                          steps=8, precision="bf16-mixed")
    assert events(guard) == [("skipped", 3), ("skipped", 5)]
    assert finite(module)
    step_counts = {int(s["step"]) for s in trainer.optimizers[0].state.values()}
    assert step_counts == {6}  # 8 optimizer steps, 2 of them skipped entirely (no weight decay)


def test_incident_rolls_back_switches_to_bf16_then_reenables_fp8():
    plugin = PretendFP8Precision(recipe="delayed")
    guard = NaNGuard(max_bad_steps=3, window=10, bf16_steps=4, check_every=2, snapshot_every=2)
    snaps = Snapshots(steps=[4, 8])
    trainer, module = fit([FaultInjection(steps=[4, 5, 6]), guard, snaps], steps=14,
                          plugins=[plugin])
    assert events(guard) == [("skipped", 4), ("skipped", 5), ("skipped", 6), ("rollback", 8),
                             ("bf16_fallback", 8), ("fp8_reenabled", 12)]
    assert "in-memory snapshot of step 4" in guard.events[3]["detail"]
    # Step 7 was good and applied; the rollback at step 8 undid it: weights == those of step 4.
    assert all(torch.equal(a, b) for a, b in zip(snaps.params[4], snaps.params[8]))
    assert [(h["event"], h["step"]) for h in plugin.history[-2:]] == [("disabled", 8),
                                                                      ("enabled", 12)]
    assert plugin.fp8_active and finite(module)


def test_non_finite_in_bf16_stops_with_a_clear_error_and_checkpoints_intact(tmp_path):
    plugin = PretendFP8Precision(recipe="delayed")
    guard = NaNGuard(max_bad_steps=2, window=10, bf16_steps=0, check_every=2)
    ckpt = Checkpoint(dirpath=str(tmp_path), every_n_train_steps=2, monitor=None, save_top_k=0)
    with pytest.raises(NonFiniteTrainingError, match="in BF16 .*so the problem is not FP8"):
        fit([FaultInjection(from_step=3), guard, ckpt], steps=20, plugins=[plugin])
    kinds = [e for e, _ in events(guard)]
    # Bad from step 3 on; flags read every 2 steps: 3 bad seen at step 6 -> rollback + BF16;
    # still bad in BF16 -> the error at the next check (step 8).
    assert kinds == ["skipped"] * 3 + ["rollback", "bf16_fallback"] + ["skipped"] * 2 + ["error"]
    last = load_checkpoint_file(tmp_path / "last.ckpt")
    assert last["global_step"] == 6  # the last checkpoint before the error, loadable
    assert all(torch.isfinite(t).all() for t in last["state_dict"].values() if t.is_floating_point())
    guard_state = last["callbacks"]["NaNGuard"]
    assert [e["event"] for e in guard_state["events"]] == ["skipped"] * 3 + ["rollback",
                                                                            "bf16_fallback"]
    assert last["PretendFP8Precision"]["history"][-1]["event"] == "disabled"


def test_plain_bf16_run_errors_without_fp8_switch():
    guard = NaNGuard(max_bad_steps=2, check_every=2)
    with pytest.raises(NonFiniteTrainingError, match="not FP8"):
        fit([FaultInjection(from_step=1, kind="grad"), guard], steps=10, precision="bf16-mixed")


def test_checkpoint_rollback_source(tmp_path):
    plugin = PretendFP8Precision(recipe="current")
    guard = NaNGuard(max_bad_steps=1, check_every=2, rollback="checkpoint", bf16_steps=0)
    ckpt = Checkpoint(dirpath=str(tmp_path), every_n_train_steps=4, monitor=None, save_top_k=0)
    fit([FaultInjection(steps=[5]), guard, ckpt], steps=8, plugins=[plugin])
    rollback = next(e for e in guard.events if e["event"] == "rollback")
    assert "last.ckpt (step 4)" in rollback["detail"]
    assert not plugin.fp8_active  # bf16_steps=0: BF16 for the rest of the run


def test_guard_arguments_are_validated():
    with pytest.raises(ConfigError, match="NaNGuard.max_bad_steps=0 must be an integer >= 1"):
        NaNGuard(max_bad_steps=0)
    with pytest.raises(ConfigError, match="rollback='disk'; valid: memory, checkpoint, none"):
        NaNGuard(rollback="disk")
