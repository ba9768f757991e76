"""Checkpoints: atomic under SIGKILL, what they record, listing, bad input, exact resume.

The fits train on a small vocabulary (the ``small_vocab`` fixture): what a checkpoint holds and
how a run resumes do not depend on the tokenizer."""

import errno
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning as L
import pytest
import torch

import fp8_lightning.checkpoint as checkpoint_module
from fp8_lightning.callbacks.checkpoint import Checkpoint
from fp8_lightning.checkpoint import (AtomicCheckpointIO, CheckpointError, atomic_torch_save,
                                      find_checkpoint, list_checkpoints, load_checkpoint_file,
                                      remove_stale_temporaries)
from fp8_lightning.commands.checkpoints import format_checkpoints
from fp8_lightning.cli import main
from fp8_lightning.config import ConfigError, GPTConfig
from fp8_lightning.te_support import fallback_precision
from tests._runs import run_cli

# What a run without FP8 records here: bf16, or fp32 on a CPU without BF16 instructions.
FALLBACK = "fp32" if fallback_precision()[0] == "32-true" else "bf16"

ROOT = Path(__file__).resolve().parents[1]




def test_sigkill_during_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    target = tmp_path / "last.ckpt"
    atomic_torch_save({"state_dict": {"w": torch.zeros(4)}, "global_step": 1,
                       "pytorch-lightning_version": "2.6.0"}, target)
    writer = textwrap.dedent(f"""
        import torch
        from fp8_lightning.checkpoint import AtomicCheckpointIO
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


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, small_vocab):
    out = tmp_path_factory.mktemp("ckpt-run")
    result = run_cli("fit", "--config", "configs/quickstart.yaml", *small_vocab,
                     "--trainer.max_steps", "10",
                     "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "2",
                     "--trainer.callbacks.init_args.every_n_train_steps", "4",
                     "--trainer.callbacks.init_args.keep_last", "2",
                     "--trainer.default_root_dir", str(out), "--data.batch_size", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    return out / "checkpoints"


def test_checkpoint_files_and_what_they_record(short_run):
    names = sorted(p.name for p in short_run.glob("*.ckpt"))
    assert "last.ckpt" in names  # keep_last=2: steps 8 and 10 (the end) kept, step 4 pruned
    assert [n for n in names if n.startswith("step-")] == ["step-0000008.ckpt", "step-0000010.ckpt"]
    best = [n for n in names if n.startswith("best-")]
    assert len(best) == 1 and best[0].startswith("best-step0000008-val")  # ranked by its own val
    last = load_checkpoint_file(short_run / "last.ckpt")
    assert last["global_step"] == 10  # written at the end, not only every 4 steps
    meta = last["fp8_lightning"]
    assert meta["precision"] == FALLBACK and meta["config"]["name"] == "tiny"
    assert set(meta["versions"]) == {"torch", "lightning", "transformer_engine"}
    assert meta["val_loss"] > 0 and last["tokens_seen"] == 10 * 4 * 128
    assert meta["val_step"] == 8  # the last validation ran at step 8, before steps 9 and 10
    assert load_checkpoint_file(short_run / best[0])["fp8_lightning"]["val_step"] == 8
    assert last["FP8Precision"]["recipe"]["recipe"] == "delayed"
    assert last["FP8Precision"]["history"][0]["event"] == "unavailable"
    loader = last["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert loader["num_samples_yielded"] == 40  # the data position, for exact resume
    assert last["TokenShardDataModule"]["position"] == 40


def test_checkpoints_command_lists_step_tokens_loss_precision_size(short_run, capsys):
    (short_run / "broken.ckpt").write_bytes((short_run / "last.ckpt").read_bytes()[:5000])
    main(["checkpoints", str(short_run.parent)])  # a run root works too
    out = capsys.readouterr().out
    last = next(line for line in out.splitlines() if line.startswith("last.ckpt"))
    assert "10" in last and "5,120" in last and FALLBACK in last and "tiny" in last
    assert re.search(r"\d\.\d{4} @step 8 ", last)  # the val loss of step 8, not of step 10
    best = next(line for line in out.splitlines() if line.startswith("best-"))
    assert re.search(r"\d\.\d{4} ", best) and "@step" not in best  # measured on its own weights
    assert "MB" in last or "KB" in last
    assert "broken.ckpt" in out and "UNREADABLE: truncated or corrupt" in out
    rows = list_checkpoints(str(short_run))
    assert [r["step"] for r in rows if "error" not in r] == sorted(
        r["step"] for r in rows if "error" not in r)


def fit_error(capsys, *args):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", "configs/quickstart.yaml", "--trainer.max_steps", "12",
              "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
              "--data.batch_size", "4", *args])
    err = capsys.readouterr().err
    error_lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert exc.value.code == 2 and len(error_lines) == 1 and "Traceback" not in err, err[-2000:]
    return error_lines[0] + err.split(error_lines[0], 1)[1]


def test_bad_checkpoints_give_one_clear_error(short_run, small_vocab, tmp_path, capsys,
                                              monkeypatch):
    monkeypatch.chdir(ROOT)
    root = [*small_vocab, "--trainer.default_root_dir", str(tmp_path)]
    assert "does not exist" in fit_error(capsys, *root, "--ckpt_path", str(tmp_path / "nope.ckpt"))
    (tmp_path / "trunc.ckpt").write_bytes((short_run / "last.ckpt").read_bytes()[:20000])
    assert "is truncated or corrupt" in fit_error(capsys, *root, "--ckpt_path",
                                                  str(tmp_path / "trunc.ckpt"))
    torch.save({"weight": torch.zeros(2)}, tmp_path / "raw.pt")
    assert "is not a Lightning checkpoint" in fit_error(capsys, *root, "--ckpt_path",
                                                        str(tmp_path / "raw.pt"))
    torch.save({"state_dict": {}, "pytorch-lightning_version": "2.6.0", "global_step": 0},
               tmp_path / "other.ckpt")
    assert "not written by fp8-lightning" in fit_error(capsys, *root, "--ckpt_path",
                                                       str(tmp_path / "other.ckpt"))
    message = fit_error(capsys, *root, "--model.config.n_layer", "3",
                        "--ckpt_path", str(short_run / "last.ckpt"))
    assert "model.config.n_layer=3 but the checkpoint was trained with n_layer=2" in message


def test_load_checkpoint_file_rejects_pickles(tmp_path):
    torch.save({"state_dict": {}, "pytorch-lightning_version": "2.6.0", "obj": Path("x")},
               tmp_path / "pickle.ckpt")
    with pytest.raises(CheckpointError, match="pathlib.*refusing to unpickle"):
        load_checkpoint_file(tmp_path / "pickle.ckpt")


# ------------------------------------------------------------------- bad input, one error line
def small_checkpoint(path, step=0, val_loss=None, val_step=None, **config_fields):
    """A checkpoint as fit writes it, without weights (enough for everything before loading)."""
    config = dict(GPTConfig(name="tiny").to_dict(), **config_fields)
    atomic_torch_save({"state_dict": {}, "pytorch-lightning_version": "2.6.0", "global_step": step,
                       "tokens_seen": 0, "hyper_parameters": {"config": config},
                       "fp8_lightning": {"config": config, "precision": "bf16",
                                         "val_loss": val_loss, "val_step": val_step}}, path)
    return path


def cli_error(capsys, *argv):
    """The message of ``python -m fp8_lightning ARGV`` (run in this process), which must fail
    with exit status 2 and one ``error:`` line, no traceback."""
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    err = capsys.readouterr().err
    error_lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert exc.value.code == 2 and len(error_lines) == 1 and "Traceback" not in err, err[-2000:]
    return err[err.index(error_lines[0]):]


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
    from fp8_lightning.module import GPTLightningModule, check_same_model

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


def test_checkpoints_shows_a_val_loss_measured_at_an_earlier_step_with_that_step():
    row = {"file": "last.ckpt", "step": 120, "tokens": 1, "val_loss": 3.21, "precision": "bf16",
           "model": "tiny", "size": 1}
    assert " 3.2100 @step 100 " in format_checkpoints([dict(row, val_step=100)])
    assert " 3.2100 " in format_checkpoints([dict(row, val_step=120)])
    assert "@step" not in format_checkpoints([dict(row, val_step=120)])
    assert " 3.2100 @step ? " in format_checkpoints([dict(row, val_step=None)])  # older version


def test_disk_full_while_writing_keeps_the_previous_checkpoint_and_says_so(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    small_checkpoint(target, step=1)
    before = target.read_bytes()

    class FullDisk(io.FileIO):  # the filesystem fills up after 64 KB of the new checkpoint
        written = 0

        def write(self, data):
            FullDisk.written += len(data)
            if FullDisk.written > 65536:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write(data)

    monkeypatch.setattr(checkpoint_module, "open", FullDisk, raising=False)
    big = {"state_dict": {"w": torch.ones(256, 1024)}, "pytorch-lightning_version": "2.6.0"}
    with pytest.raises(CheckpointError, match=rf"^could not write checkpoint "
                                              rf"{re.escape(repr(str(target)))}: no space left on "
                                              r"device \(.* free there\); last.ckpt was left as"):
        AtomicCheckpointIO().save_checkpoint(big, target)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # the temporary is gone
    monkeypatch.undo()

    def failing_save(obj, f):  # torch's own report of a failed write, without an OSError
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter "
                           "failed writing file data/0: file write failed")

    monkeypatch.setattr(checkpoint_module.torch, "save", failing_save)
    with pytest.raises(CheckpointError, match=r"PytorchStreamWriter failed writing file data/0: "
                                              r"file write failed \("):
        atomic_torch_save(big, target)
    assert target.read_bytes() == before and len(list(tmp_path.iterdir())) == 1


def test_temporaries_of_killed_writes_are_removed_when_checkpointing_starts(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    for name in ("last.ckpt", "best.ckpt"):
        (directory / name).write_bytes(b"complete")
    (directory / f".last.ckpt.tmp-{dead.pid}").write_bytes(b"torn")  # a single-file write
    (directory / f".best.ckpt.tmp-{dead.pid}").mkdir()  # a sharded write
    (directory / f".best.ckpt.tmp-{dead.pid}" / "__0_0.distcp").write_bytes(b"torn")
    (directory / f".last.ckpt.tmp-{os.getpid()}").write_bytes(b"being written")  # running: kept
    (directory / f".first.ckpt.tmp-{dead.pid}").write_bytes(b"?")  # first.ckpt missing: kept

    trainer = L.Trainer(default_root_dir=tmp_path, callbacks=[Checkpoint()], logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with caplog.at_level(logging.INFO, logger="fp8_lightning.checkpoint"):
        trainer.checkpoint_callback.setup(trainer, L.LightningModule(), "fit")

    assert sorted(p.name for p in directory.iterdir()) == [
        f".first.ckpt.tmp-{dead.pid}", f".last.ckpt.tmp-{os.getpid()}", "best.ckpt", "last.ckpt"]
    (removed,) = [r.message for r in caplog.records if "removed" in r.message]
    assert f"removed 2 temporaries left by killed writes in {directory}" in removed
    (kept,) = [r.message for r in caplog.records if r.levelno == logging.WARNING
               and "kept" in r.message]
    assert f".first.ckpt.tmp-{dead.pid}" in kept and "may be the only copy" in kept
    assert remove_stale_temporaries(directory) == []  # nothing left to do


# ------------------------------------------------------------------------------ exact resume
RESUME = ["fit", "--config", "configs/quickstart.yaml", "--trainer.limit_val_batches", "0",
          "--trainer.enable_progress_bar", "false", "--data.batch_size", "4",
          "--trainer.callbacks.init_args.every_n_train_steps", "6",
          "--trainer.callbacks.init_args.monitor", "null",
          "--trainer.callbacks.init_args.save_top_k", "0",
          "--trainer.callbacks.init_args.keep_last", "4"]


def records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def batch_log(path):
    return ["--trainer.callbacks+=tests.helpers.BatchLog", "--trainer.callbacks.path", str(path)]


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, small_vocab):
    """12 steps straight; and the same run SIGKILLed at step 6 (after its checkpoint)."""
    tmp = tmp_path_factory.mktemp("resume")
    straight = run_cli(*RESUME, *small_vocab, "--trainer.max_steps", "12",
                       "--trainer.default_root_dir", str(tmp / "straight"),
                       *batch_log(tmp / "straight.jsonl"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = run_cli(*RESUME, *small_vocab, "--trainer.max_steps", "12",
                     "--trainer.default_root_dir", str(tmp / "run"),
                     *batch_log(tmp / "first.jsonl"),
                     "--trainer.callbacks+=tests.helpers.KillAt", "--trainer.callbacks.step", "6")
    assert killed.returncode == -signal.SIGKILL
    return tmp


def test_resume_after_sigkill_sees_exactly_the_same_batches_and_losses(killed_run, small_vocab):
    tmp = killed_run
    resumed = run_cli(*RESUME, *small_vocab, "--trainer.max_steps", "12",
                      "--trainer.default_root_dir", str(tmp / "run"),
                      *batch_log(tmp / "resumed.jsonl"), "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "data: resumed at block 24 of epoch 1 (verified)" in resumed.stderr
    straight, first, after = (records(tmp / f) for f in ("straight.jsonl", "first.jsonl",
                                                          "resumed.jsonl"))
    assert [r["step"] for r in first] == list(range(6))
    assert [r["step"] for r in after] == list(range(6, 12))
    for a, b in zip(straight, first + after):  # batches, LR, losses, tokens seen: identical
        assert (a["step"], a["batch"], a["lr"], a["tokens_seen"]) == \
               (b["step"], b["batch"], b["lr"], b["tokens_seen"])
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)


def test_resume_with_another_batch_size_continues_the_same_sample_stream(killed_run, small_vocab):
    tmp = killed_run
    resumed = run_cli(*RESUME, *small_vocab, "--trainer.max_steps", "9", "--data.batch_size", "8",
                      "--trainer.default_root_dir", str(tmp / "run"),
                      *batch_log(tmp / "bs8.jsonl"), "--ckpt_path",
                      str(tmp / "run" / "checkpoints" / "step-0000006.ckpt"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = [s for r in records(tmp / "straight.jsonl") for s in r["samples"]]
    after = [s for r in records(tmp / "bs8.jsonl") for s in r["samples"]]
    assert after == straight[24:48]  # samples 24.. of the stream: nothing replayed or skipped


def test_resume_with_another_seq_len_stops_with_a_clear_error(killed_run, small_vocab, capsys,
                                                              monkeypatch):
    monkeypatch.chdir(ROOT)
    message = fit_error(capsys, *small_vocab, "--trainer.default_root_dir",
                        str(killed_run / "other"),
                        "--model.config.block_size", "64", "--ckpt_path",
                        str(killed_run / "run" / "checkpoints" / "step-0000006.ckpt"))
    assert "block_size=64 but the checkpoint was trained with block_size=128" in message


def test_data_state_mismatch_names_the_field():
    from fp8_lightning.config import ConfigError
    from fp8_lightning.data.streaming import TokenShardDataModule

    data = TokenShardDataModule(seq_len=64, batch_size=4)
    state = dict(TokenShardDataModule(seq_len=128, batch_size=4).state_dict(), seed=7)
    with pytest.raises(ConfigError, match=r"(?s)data.seq_len=64 but the checkpoint was trained "
                                          r"with 128 .*data.seed=42 but .* with 7"):
        data.load_state_dict(state)
