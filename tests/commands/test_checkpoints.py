"""The ``checkpoints`` command and what a fit's checkpoint files record; a bad ``--ckpt_path`` is one
error line (``fp8_lightning/commands/checkpoints.py``).

The fits train on a small vocabulary (the ``small_vocab`` fixture): what a checkpoint holds does
not depend on the tokenizer."""

import re

import pytest
import torch

from fp8_lightning.checkpoint import list_checkpoints, load_checkpoint_file
from fp8_lightning.cli import main
from fp8_lightning.commands.checkpoints import format_checkpoints
from tests._runs import ROOT, fit_error
from tests._runs import run_cli
from tests.helpers import FALLBACK


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


def test_checkpoints_shows_a_val_loss_measured_at_an_earlier_step_with_that_step():
    row = {"file": "last.ckpt", "step": 120, "tokens": 1, "val_loss": 3.21, "precision": "bf16",
           "model": "tiny", "size": 1}
    assert " 3.2100 @step 100 " in format_checkpoints([dict(row, val_step=100)])
    assert " 3.2100 " in format_checkpoints([dict(row, val_step=120)])
    assert "@step" not in format_checkpoints([dict(row, val_step=120)])
    assert " 3.2100 @step ? " in format_checkpoints([dict(row, val_step=None)])  # older version
