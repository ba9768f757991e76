"""The Checkpoint callback (``fp8_lightning/callbacks/checkpoint.py``): a full disk or a killed
write never costs the previous checkpoint, and a run killed mid-training resumes with exactly the
same batches and losses.

The fits train on a small vocabulary (the ``small_vocab`` fixture): how a run resumes does not
depend on the tokenizer."""

import errno
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from fp8_lightning.callbacks.checkpoint import Checkpoint
import fp8_lightning.checkpoint_files as checkpoint_module
from fp8_lightning.checkpoint_files import (AtomicCheckpointIO, CheckpointError, atomic_torch_save,
                                      remove_stale_temporaries)
from fp8_lightning.config import GPTConfig
from tests._runs import ROOT, fit_error, run_cli, run_here, run_main_logged
from tests.helpers import small_checkpoint


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
    with caplog.at_level(logging.INFO, logger="fp8_lightning.checkpoint_files"):
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
    """12 steps straight (in this process: the reference run's process is not under test); and
    the same run SIGKILLed at step 6 (after its checkpoint), a process of its own."""
    tmp = tmp_path_factory.mktemp("resume")
    code, log = run_here(*RESUME, *small_vocab, "--trainer.max_steps", "12",
                         "--trainer.default_root_dir", str(tmp / "straight"),
                         *batch_log(tmp / "straight.jsonl"))
    assert code == 0, log[-3000:]
    killed = run_cli(*RESUME, *small_vocab, "--trainer.max_steps", "12",
                     "--trainer.default_root_dir", str(tmp / "run"),
                     *batch_log(tmp / "first.jsonl"),
                     "--trainer.callbacks+=tests.helpers.KillAt", "--trainer.callbacks.step", "6")
    assert killed.returncode == -signal.SIGKILL
    return tmp


def test_resume_after_sigkill_sees_exactly_the_same_batches_and_losses(killed_run, small_vocab,
                                                                       capsys):
    """The resumes run in this process: what they read and compute is under test, not their
    launch."""
    tmp = killed_run
    code, log = run_main_logged(capsys, [*RESUME, *small_vocab, "--trainer.max_steps", "12",
                                         "--trainer.default_root_dir", str(tmp / "run"),
                                         *batch_log(tmp / "resumed.jsonl"), "--ckpt_path", "last"])
    assert code == 0, log[-3000:]
    assert "data: resumed at block 24 of epoch 1 (verified)" in log
    straight, first, after = (records(tmp / f) for f in ("straight.jsonl", "first.jsonl",
                                                          "resumed.jsonl"))
    assert [r["step"] for r in first] == list(range(6))
    assert [r["step"] for r in after] == list(range(6, 12))
    for a, b in zip(straight, first + after):  # batches, LR, losses, tokens seen: identical
        assert (a["step"], a["batch"], a["lr"], a["tokens_seen"]) == \
               (b["step"], b["batch"], b["lr"], b["tokens_seen"])
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)


@pytest.fixture(scope="module")
def short_epochs(tmp_path_factory):
    """CLI arguments for a fit whose epoch is 8 steps: 158 training blocks, 16 per step, two
    loader workers (79 blocks each, 4 whole micro-batches per worker)."""
    from fp8_lightning.data.prepare import prepare
    from fp8_lightning.data.streaming import EMBEDDED_CORPUS, preserved_rng
    from tests._runs import BYTES_VOCAB, byte_tokenizer

    root = tmp_path_factory.mktemp("short-epochs")
    (root / "corpus.txt").write_text(EMBEDDED_CORPUS.read_text()[:24_000])
    with preserved_rng():
        prepare([str(root / "corpus.txt")], str(root / "ds"),
                tokenizer=str(byte_tokenizer(root / "tokenizer.json")), seq_len=128,
                val_fraction=0.15, num_workers=1)
    return ["--data.data_dir", str(root / "ds"), "--data.tokenizer", str(root / "tokenizer.json"),
            "--model.config.vocab_size", str(BYTES_VOCAB), "--data.batch_size", "16",
            "--data.num_workers", "2", "--trainer.max_steps", "20",
            "--trainer.callbacks.init_args.every_n_train_steps", "4"]


def test_a_run_resumed_mid_epoch_reads_the_next_epochs_as_a_run_that_never_stopped(
        short_epochs, tmp_path, capsys):
    """Killed at step 6 of the first epoch (its checkpoint: step 4), resumed to step 20: epochs 2
    and 3 are new shuffles, not a replay of the resumed epoch's rest."""
    code, log = run_here(*RESUME, *short_epochs, "--trainer.default_root_dir",
                         str(tmp_path / "straight"), *batch_log(tmp_path / "straight.jsonl"))
    assert code == 0, log[-3000:]
    killed = run_cli(*RESUME, *short_epochs, "--trainer.default_root_dir", str(tmp_path / "run"),
                     *batch_log(tmp_path / "first.jsonl"),
                     "--trainer.callbacks+=tests.helpers.KillAt", "--trainer.callbacks.step", "6")
    assert killed.returncode == -signal.SIGKILL
    code, log = run_main_logged(capsys, [*RESUME, *short_epochs, "--trainer.default_root_dir",
                                         str(tmp_path / "run"), "--ckpt_path", "last",
                                         *batch_log(tmp_path / "resumed.jsonl")])
    assert code == 0, log[-3000:]
    assert "data: resumed at block 64 of epoch 1 (verified)" in log
    straight = [r["batch"] for r in records(tmp_path / "straight.jsonl")]
    after = records(tmp_path / "resumed.jsonl")
    assert [r["step"] for r in after] == list(range(4, 20))
    assert [r["batch"] for r in after] == straight[4:20]


def test_resume_with_another_batch_size_continues_the_same_sample_stream(killed_run, small_vocab,
                                                                        capsys):
    tmp = killed_run
    code, log = run_main_logged(capsys, [*RESUME, *small_vocab, "--trainer.max_steps", "9",
                                         "--data.batch_size", "8",
                                         "--trainer.default_root_dir", str(tmp / "run"),
                                         *batch_log(tmp / "bs8.jsonl"), "--ckpt_path",
                                         str(tmp / "run" / "checkpoints" / "step-0000006.ckpt")])
    assert code == 0, log[-3000:]
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


def test_ckpt_path_last_resumes_from_the_runs_checkpoint_directory(tmp_path):
    """``trainer.fit(ckpt_path="last")`` (the Python API; the CLI resolves ``last`` itself) with a
    logger: Lightning alone would look in the logger's ``version_N/checkpoints``, where nothing
    is; the callback's directory is ``<root>/checkpoints``, and ``last`` is looked up there. A
    killed write's temporary there is never taken (Lightning's suffix check already skips
    ``.last.ckpt.tmp-PID``; the callback's own filter is the second guard)."""
    from lightning.pytorch.loggers import CSVLogger

    from fp8_lightning.module import GPTLightningModule

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / ".last.ckpt.tmp-123").mkdir()  # a kill mid-write left it
    tokens = torch.randint(0, 257, (8, 17), generator=torch.Generator().manual_seed(0))

    def fit(steps):
        module = GPTLightningModule(config=GPTConfig(name="tiny", n_layer=1, block_size=16,
                                                     vocab_size=257), backend="torch",
                                    warmup_steps=1)
        trainer = L.Trainer(default_root_dir=tmp_path, callbacks=[Checkpoint(monitor=None)],
                            max_steps=steps, accelerator="cpu", logger=CSVLogger(tmp_path),
                            enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0)
        trainer.fit(module, torch.utils.data.DataLoader(tokens, batch_size=4), ckpt_path="last")
        return trainer

    assert fit(2).global_step == 2  # nothing to resume: a fresh start, and last.ckpt written
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    resumed = fit(3)  # a new logger version: Lightning's own lookup would find nothing
    assert resumed.ckpt_path == str(tmp_path / "checkpoints" / "last.ckpt")
    assert resumed.global_step == 3



@pytest.mark.parametrize("sharded", [True, False])
def test_keep_last_rotates_sharded_directories_and_files(tmp_path, sharded):
    """``keep_last`` keeps the newest N periodic copies of ``last.ckpt``, whether it is one file or
    a sharded directory (FSDP2); removing an old directory once raised UnboundLocalError at the
    first rotation, killing the run."""
    callback = Checkpoint(dirpath=str(tmp_path), keep_last=2)
    last = tmp_path / "last.ckpt"
    for step in (100, 200, 300):
        if sharded:
            last.mkdir(exist_ok=True)  # a directory of shards, as DCP writes it
            (last / "__0_0.distcp").write_bytes(b"shard %d" % step)
            (last / "meta.pt").write_bytes(b"meta %d" % step)
        else:
            last.unlink(missing_ok=True)
            last.write_bytes(b"weights %d" % step)
        callback._keep(last, step)
    kept = sorted(p.name for p in tmp_path.glob("step-*.ckpt"))
    assert kept == ["step-0000200.ckpt", "step-0000300.ckpt"]
    newest = tmp_path / "step-0000300.ckpt"
    content = (newest / "__0_0.distcp") if sharded else newest
    assert content.read_bytes().endswith(b"300") and last.exists()
