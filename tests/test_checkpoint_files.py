"""The checkpoint file (``fp8_lightning/checkpoint_files.py``): atomic writes under SIGKILL, loading
without unpickling, what a recorded config this version does not know does, ``--ckpt_path
last|best`` and the directory publish that sharded checkpoints use.

The callback that writes them is ``tests/callbacks/test_checkpoint.py``; the ``checkpoints`` command
``tests/commands/test_checkpoints.py``."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from fp8_lightning.checkpoint_files import (CheckpointError, atomic_torch_save, find_checkpoint,
                                      load_checkpoint_file, publish_directory)
from fp8_lightning.config import ConfigError, GPTConfig
from tests._runs import ROOT, cli_error
from tests.helpers import small_checkpoint



def test_sigkill_during_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    target = tmp_path / "last.ckpt"
    atomic_torch_save({"state_dict": {"w": torch.zeros(4)}, "global_step": 1,
                       "pytorch-lightning_version": "2.6.0"}, target)
    writer = textwrap.dedent(f"""
        import torch
        from fp8_lightning.checkpoint_files import AtomicCheckpointIO
        big = {{"state_dict": {{"w": torch.ones(64, 1024, 1024)}}, "global_step": 2,  # 256 MB
               "pytorch-lightning_version": "2.6.0"}}
        while True:
            AtomicCheckpointIO().save_checkpoint(big, {str(target)!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], cwd=ROOT)
    try:
        deadline = time.time() + 120
        while not list(tmp_path.glob(".last.ckpt.tmp-*")):  # the new file is being written
            assert time.time() < deadline and proc.poll() is None, "writer never started"
            time.sleep(0.005)
        time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    checkpoint = load_checkpoint_file(target)  # never torn: the old file or a complete new one
    assert checkpoint["global_step"] in (1, 2)


def test_load_checkpoint_file_rejects_pickles(tmp_path):
    torch.save({"state_dict": {}, "pytorch-lightning_version": "2.6.0", "obj": Path("x")},
               tmp_path / "pickle.ckpt")
    with pytest.raises(CheckpointError, match="pathlib.*refusing to unpickle"):
        load_checkpoint_file(tmp_path / "pickle.ckpt")


# ------------------------------------------------------------------- bad input, one error line
QUICKSTART = ("--config", "configs/quickstart.yaml")


def test_a_recorded_config_field_this_version_does_not_know_is_one_error(tmp_path, capsys,
                                                                          monkeypatch):
    monkeypatch.chdir(ROOT)
    future = small_checkpoint(tmp_path / "future.ckpt", moe_experts=8)
    for argv in (["generate", "--ckpt", str(future), "--device", "cpu"],
                 ["fit", *QUICKSTART, "--trainer.default_root_dir", str(tmp_path / "run"),
                  "--ckpt_path", str(future)]):
        message = cli_error(capsys, *argv)
        assert str(future) in message, message
        assert "moe_experts: not a field of this version's GPTConfig" in message
        assert "valid fields: name, vocab_size, block_size" in message
    assert not (tmp_path / "run").exists()  # refused before anything started
    # Python API: a module rebuilt from the checkpoint's hyperparameters, a resume's model check
    from fp8_lightning.module import GPTLightningModule
    from fp8_lightning.resume import check_same_model

    config = torch.load(future, weights_only=True)["hyper_parameters"]["config"]
    with pytest.raises(ConfigError, match="moe_experts: not a field"):
        GPTLightningModule(config=config, backend="torch")
    with pytest.raises(ConfigError, match="moe_experts: not a field"):
        check_same_model(config, GPTConfig(name="tiny"))


def test_ckpt_path_last_or_best_with_nothing_there_is_an_error_not_a_fresh_start(
        tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    run = tmp_path / "run"
    message = cli_error(capsys, "fit", *QUICKSTART, "--trainer.default_root_dir", str(run),
                        "--ckpt_path", "last")
    assert f"--ckpt_path last: no last.ckpt to resume from in {str(run / 'checkpoints')!r} " \
           "(it does not exist)" in message, message
    small_checkpoint(run / "checkpoints" / "last.ckpt", step=10, val_loss=2.0, val_step=8)
    message = cli_error(capsys, "validate", *QUICKSTART, "--trainer.default_root_dir", str(run),
                        "--ckpt_path", "best")
    assert "--ckpt_path best: no checkpoint validated at its own step" in message
    assert "it holds last.ckpt" in message
    assert sorted(p.name for p in run.rglob("*")) == ["checkpoints", "last.ckpt"]  # no training
    # `best` names the best-k checkpoint, which is then checked like any other
    small_checkpoint(run / "checkpoints" / "best-step0000008.ckpt", step=8, val_loss=2.0,
                     val_step=8, moe_experts=8)
    message = cli_error(capsys, "validate", *QUICKSTART, "--trainer.default_root_dir", str(run),
                        "--ckpt_path", "best")
    assert str(run / "checkpoints" / "best-step0000008.ckpt") in message and "moe_experts" in message


def test_last_is_the_newest_last_checkpoint_and_best_the_lowest_loss_of_its_own_weights(tmp_path):
    small_checkpoint(tmp_path / "last.ckpt", step=10, val_loss=1.5, val_step=8)
    small_checkpoint(tmp_path / "last-v1.ckpt", step=12, val_loss=1.5, val_step=8)
    os.utime(tmp_path / "last.ckpt", (time.time() - 60,) * 2)
    small_checkpoint(tmp_path / "best-step0000004.ckpt", step=4, val_loss=2.5, val_step=4)
    small_checkpoint(tmp_path / "best-step0000008.ckpt", step=8, val_loss=2.0, val_step=8)
    small_checkpoint(tmp_path / "step-0000010.ckpt", step=10, val_loss=1.0, val_step=8)  # older val
    (tmp_path / "best-broken.ckpt").write_bytes(b"not a checkpoint")
    (tmp_path / ".last.ckpt.tmp-1").write_bytes(b"torn")
    assert find_checkpoint("last", tmp_path) == str(tmp_path / "last-v1.ckpt")
    assert find_checkpoint("best", tmp_path) == str(tmp_path / "best-step0000008.ckpt")


def test_publish_directory_replaces_atomically_and_leaves_no_temporaries(tmp_path):
    target = tmp_path / "last.ckpt"
    for generation in ("old", "new"):
        tmp = tmp_path / f".last.ckpt.tmp-{generation}"
        tmp.mkdir()
        (tmp / "shard").write_text(generation)
        publish_directory(tmp, target)
        assert (target / "shard").read_text() == generation
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
