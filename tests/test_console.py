"""What a user sees: the package's lines, and none of the libraries' noise (CPU, as a user runs it)."""

import re

from tests._runs import run_main_logged, small_vocab, small_vocab_fit, two_worker_prepare
from tests.data import PARTS
from fp8_lightning.console import _without_unknown_flops

# Lines that must never reach the console: adverts, litdata's worker chatter and progress bars,
# warnings that do not apply to these runs, deprecations inside the libraries, Lightning's
# FLOPs that were never counted, and lines about accelerators the package does not use.
NOISE = ("Create an account", "💡 Tip", "lightning.ai", "Storing the files under",
         "Setup started", "Setup finished", "Workers are", "Worker 0", "Worker 1",
         "inferred the following", "Finished data processing", "start_method", "Progress:",
         "TPU available", "HPU available", "is deprecated", "Your `IterableDataset` has `__len__`",
         "does not have many workers", "persistent_workers", "Checkpoint directory",
         "smaller than the logging interval", "Total Flops", "FLOPs", "Traceback")


def assert_quiet(text):
    found = [n for n in NOISE if n in text]
    assert not found, (found, text[-4000:])


def plain(text):
    """The text without the progress bar's carriage returns and cursor moves."""
    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text).replace("\r", "\n")


def test_fit_shows_what_ran_and_nothing_else(tmp_path_factory):
    _, result = small_vocab_fit(tmp_path_factory)  # the quickstart, on a small vocabulary
    out, err = plain(result.stdout), plain(result.stderr)
    assert_quiet(out + err)
    assert re.search(r"^precision: \S+", err, re.M), err
    assert re.search(r"^data: .*train / .* val blocks of 129 tokens", err, re.M), err
    assert re.search(r"^step 5 \| loss [\d.]+ \| lr .* \| tok/s [\d,]+ \| mfu n/a \| ", out, re.M), out
    assert re.search(r"^step 10 \| val/loss [\d.]+ \| val/ppl", out, re.M), out
    assert "sample (step 10): 'ROMEO:" in out
    # The model summary keeps its parameter counts.
    assert "Trainable params" in err and "GPT" in err
    # The fallback's reason once (the precision line), a short tag on every step line.
    reason = re.search(r"^precision: (?:BF16|FP32) \(fallback: (.+)\)$", err, re.M)
    assert reason and (out + err).count(reason[1]) == 1, err
    assert re.search(r"^step 10 \| .* \| (BF16|FP32) \(fallback\)$", out, re.M), out


def test_fit_ends_with_a_summary_and_the_next_commands(tmp_path_factory):
    run_dir, result = small_vocab_fit(tmp_path_factory)
    out = plain(result.stdout)
    last = run_dir / "checkpoints" / "last.ckpt"
    done = re.search(r"^done: step 10, ([\d,]+) tokens seen; this run took [\d.]+ (?:s|min); "
                     r"train loss [\d.]+, val loss ([\d.]+)$", out, re.M)
    assert done and int(done[1].replace(",", "")) == 10 * 8 * 128, out[-2000:]
    assert f"checkpoints: {last.parent}" in out and last.is_file()
    assert f"sample: python -m fp8_lightning generate --ckpt {last} --prompt" in out
    # twice the steps, the schedule as it was (its end: the minimum learning rate from here on)
    assert ("continue: the same command with --ckpt_path last --trainer.max_steps 20 "
            "--model.lr_decay_steps 10") in out
    # the summary comes last: no progress-bar fragment after it
    assert out.rstrip().splitlines()[-1].startswith("continue: ")


def test_prepare_prints_one_line_per_split_and_a_summary(tmp_path_factory):
    """`python -m fp8_lightning prepare` (the CLI, two spawned workers) writes both splits and
    prints a line per split and a summary, nothing else."""
    # six files and two (spawned) workers: both write to the console (the run is shared with
    # tests/data/test_prepare.py's, which compares its dataset with another run's)
    inputs, result = two_worker_prepare(tmp_path_factory)
    out_dir = inputs / "ds"
    text = result.stdout + result.stderr
    assert_quiet(text)
    # (progress lines, every few seconds of a longer prepare, are tests/data/test_prepare.py's)
    lines = [line for line in text.splitlines() if line.strip()
             and not re.match(r"prepare: (tokenizing (train|val)|reading inputs): ", line)]
    assert lines[:2] == [f"prepare: tokenizing {len(PARTS)} file(s) -> {out_dir / split}"
                         for split in ("train", "val")], lines
    assert re.fullmatch(rf"prepare: {len(PARTS)} documents, [\d,]+ train \+ [\d,]+ val tokens, "
                        rf"\d+ shards -> {re.escape(str(out_dir))}", lines[2]), lines
    assert len(lines) == 3, lines
    assert all((out_dir / split / "index.json").is_file() for split in ("train", "val"))


def test_model_summary_drops_flops_only_when_uncounted():
    table = ("\n  | Name  | Type | Params | Mode  | FLOPs\n----------------------------------------\n"
             "0 | model | GPT  | 3.3 M  | train | 0    \n----------------------------------------\n"
             "3.3 M     Total params\n0         Total Flops")
    quiet = _without_unknown_flops(table)
    assert "FLOPs" not in quiet and "Total Flops" not in quiet
    assert "0 | model | GPT  | 3.3 M  | train" in quiet and "3.3 M     Total params" in quiet
    assert all(len(line) == len(quiet.splitlines()[1]) for line in quiet.splitlines()
               if line.startswith("---"))
    counted = table.replace("0         Total Flops", "1.2 G     Total Flops")
    assert _without_unknown_flops(counted) == counted


def test_a_resumed_fit_says_how_many_steps_it_ran(tmp_path_factory, tmp_path, capsys):
    """(The resume runs in this process: its closing lines are under test, not its launch.)"""
    run_dir, _ = small_vocab_fit(tmp_path_factory)
    import shutil

    shutil.copytree(run_dir / "checkpoints", tmp_path / "checkpoints")  # the shared run untouched
    code, log = run_main_logged(capsys, [
        "fit", "--config", "configs/quickstart.yaml", *small_vocab(tmp_path_factory),
        "--trainer.max_steps", "12", "--trainer.limit_val_batches", "0",
        "--trainer.default_root_dir", str(tmp_path), "--ckpt_path", "last",
        "--model.lr_decay_steps", "10"])
    out = plain(log)
    assert code == 0, out[-2000:]
    assert re.search(r"^done: step 12 \(2 in this run\), [\d,]+ tokens seen; ", out, re.M), \
        out[-1500:]
    assert "--trainer.max_steps 24 --model.lr_decay_steps 10" in out
