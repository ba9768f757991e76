"""The ``checkpoints`` command and what a fit's checkpoint files record; a bad ``--ckpt_path`` is one
error line (``fp8_lightning/commands/checkpoints.py``).

The fits train on a small vocabulary (the ``small_vocab`` fixture): what a checkpoint holds does
not depend on the tokenizer."""

import re

import pytest
import torch

from fp8_lightning.checkpoint_files import list_checkpoints, load_checkpoint_file
from fp8_lightning.cli import main
from tests._runs import ROOT, fit_error, run_here
from tests.helpers import DURATION, FALLBACK, small_checkpoint


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, small_vocab):
    """The checkpoints of a 10-step fit, run in this process (what it writes is under test, not
    its launch)."""
    out = tmp_path_factory.mktemp("ckpt-run")
    code, log = run_here("fit", "--config", "configs/quickstart.yaml", *small_vocab,
                         "--trainer.max_steps", "10",
                         "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "2",
                         "--trainer.callbacks.init_args.every_n_train_steps", "4",
                         "--trainer.callbacks.init_args.keep_last", "2",
                         "--trainer.default_root_dir", str(out), "--data.batch_size", "4")
    assert code == 0, log[-3000:]
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
    assert re.search(r" none at step 10 \(\d\.\d{4} was step 8's\) ", last)  # not step 10's
    best = next(line for line in out.splitlines() if line.startswith("best-"))
    assert re.search(r" \d\.\d{4} ", best) and "was step" not in best  # its own weights'
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


def test_checkpoints_shows_a_loss_as_the_files_own_only_where_it_was_measured_at_its_step(
        tmp_path, capsys):
    """last.ckpt written at step 300 after a validation at step 200 has no loss of its own: the
    listing says so before it shows step 200's, which a bare number would pass off as its own."""
    small_checkpoint(tmp_path / "best-step0000200.ckpt", step=200, val_loss=5.8629, val_step=200)
    small_checkpoint(tmp_path / "last.ckpt", step=300, val_loss=5.8629, val_step=200)
    small_checkpoint(tmp_path / "old.ckpt", step=100, val_loss=6.1, val_step=None)
    small_checkpoint(tmp_path / "step-0000050.ckpt", step=50)
    main(["checkpoints", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("file"))
    column = header.index("val loss")

    def val_loss(name):  # the "val loss" cell of the file's row
        line = next(line for line in lines if line.startswith(name))
        return line[column:header.index("precision")].strip()

    assert val_loss("best-step0000200.ckpt") == "5.8629"
    assert val_loss("last.ckpt") == "none at step 300 (5.8629 was step 200's)"
    assert val_loss("old.ckpt") == "unknown (6.1000 at an unrecorded step)"  # an older version's
    assert val_loss("step-0000050.ckpt") == "-"  # no validation before it


def sharded_of_size(path, megabytes):
    """A sharded checkpoint (DCP shards and Lightning's meta.pt) of about ``megabytes`` MB."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process, on purpose
        warnings.simplefilter("ignore")
        dcp.save({"state_dict": {f"model.w{i}": torch.randn(512, 512) for i in range(megabytes)}},
                 checkpoint_id=path, no_dist=True)
    torch.save({"pytorch-lightning_version": "2.6.0", "global_step": 7}, path / "meta.pt")
    return path


def test_consolidate_prints_the_bytes_read_and_written_of_the_total_while_it_works(
        tmp_path, capsys, monkeypatch):
    from fp8_lightning import progress
    from fp8_lightning.checkpoint_files import human_size

    src = sharded_of_size(tmp_path / "last.ckpt", 64)
    total = human_size(sum(f.stat().st_size for f in src.iterdir()))
    monkeypatch.setattr(progress, "EVERY_S", 0.005)  # a line every 5 ms: each phase takes longer
    main(["consolidate", str(src), str(tmp_path / "one.ckpt")])
    lines = capsys.readouterr().out.splitlines()
    amount = (rf"[\d.]+ [KMG]?B of {total} \(\d+%\), {DURATION} so far"
              rf"(, about {DURATION} left|, finishing)?")
    reading = [line for line in lines if line.startswith(f"consolidate: reading {src}: ")]
    writing = [line for line in lines
               if line.startswith(f"consolidate: writing {tmp_path / 'one.ckpt'}: ")]
    assert reading and all(re.fullmatch(rf"consolidate: reading {src}: {amount}", line)
                           for line in reading), lines
    assert writing and all(re.fullmatch(rf"consolidate: writing \S+: {amount}", line)
                           for line in writing), lines
    for phase in (reading, writing):  # done only grows (the written file is renamed at its end)
        shares = [int(re.search(r"\((\d+)%\)", line)[1]) for line in phase]
        assert shares == sorted(shares), phase
    assert lines.index(reading[-1]) < lines.index(writing[0])  # reads all, then writes
    assert lines[-1].startswith(f"{tmp_path / 'one.ckpt'} (") and len(lines) == \
        len(reading) + len(writing) + 1  # then its one closing line


def test_consolidate_of_a_small_checkpoint_prints_only_its_closing_line(tmp_path, capsys):
    src = sharded_of_size(tmp_path / "last.ckpt", 1)
    main(["consolidate", str(src)])  # the default interval: longer than this takes
    out = capsys.readouterr().out
    assert out == (f"{tmp_path / 'consolidated-step0000007.ckpt'} (1.0 MB): one file, loads on "
                   "one GPU or the CPU\n")
