"""A fit stopped by SIGTERM or Ctrl-C saves the step it stopped at, exits 128+signal with one
line saying how to resume, and resumes from there (CPU, through the CLI as a user runs it; on a
small vocabulary, the ``small_vocab`` fixture: the point is the signals, not the tokenizer)."""

import subprocess
import sys
from pathlib import Path

import torch

from tests._runs import run_main_logged

ROOT = Path(__file__).resolve().parents[1]


def fit_argv(root, data, *args):
    return ["fit", "--config", "configs/quickstart.yaml", *data, "--trainer.max_steps", "50",
            "--trainer.limit_val_batches", "2", "--trainer.val_check_interval", "50",
            "--trainer.default_root_dir", str(root), *args]


def fit(root, data, *args, new_session=False):
    return subprocess.run([sys.executable, "-m", "fp8_lightning", *fit_argv(root, data, *args)],
                          cwd=ROOT, text=True, capture_output=True, timeout=600,
                          start_new_session=new_session)


def signal_at(step, name, group=False, times=1, rank=None):
    return ["--trainer.callbacks+", "tests.helpers.SignalAt", "--trainer.callbacks.step", str(step),
            "--trainer.callbacks.signal", name, "--trainer.callbacks.group", str(group).lower(),
            "--trainer.callbacks.times", str(times)] + (
                [] if rank is None else ["--trainer.callbacks.rank", str(rank)])


def error_lines(result):
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def saved_step(root):
    return torch.load(root / "checkpoints" / "last.ckpt", weights_only=True, mmap=True)["global_step"]


def test_sigterm_saves_the_step_exits_143_and_resumes(tmp_path, small_vocab, capsys):
    stop = signal_at(3, "SIGTERM")
    result = fit(tmp_path, small_vocab, *stop)
    assert result.returncode == 143, result.stderr[-3000:]
    assert error_lines(result) == [
        f"error: stopped by SIGTERM at step 3 (before the end of the run); the last checkpoint is "
        f"{tmp_path / 'checkpoints' / 'last.ckpt'}. Resume with the same command and --ckpt_path last"]
    assert "Traceback" not in result.stderr
    assert saved_step(tmp_path) == 3
    # What the line says: the same command with --ckpt_path last (here, to step 5), in this
    # process: the resume is under test here, not the signals (its SignalAt step is behind it).
    code, log = run_main_logged(capsys, fit_argv(tmp_path, small_vocab, *stop, "--ckpt_path",
                                                 "last", "--trainer.max_steps", "5",
                                                 "--trainer.log_every_n_steps", "1"))
    assert code == 0, log[-3000:]
    assert not [line for line in log.splitlines() if line.startswith("error:")]
    steps = [line.split(" |")[0] for line in log.replace("\r", "\n").splitlines()
             if line.startswith("step ") and "| loss" in line]
    assert steps == ["step 4", "step 5"], steps
    assert saved_step(tmp_path) == 5


def test_ctrl_c_to_the_process_group_stops_after_the_step_and_exits_130(tmp_path, small_vocab):
    # As a terminal sends it: to the trainer and its data-loader worker alike.
    result = fit(tmp_path, small_vocab, *signal_at(3, "SIGINT", group=True), new_session=True)
    assert result.returncode == 130, result.stderr[-3000:]
    (line,) = error_lines(result)
    assert line.startswith("error: stopped by SIGINT at step 3 ") and line.endswith(
        "Resume with the same command and --ckpt_path last"), line
    assert result.stderr.count("Ctrl-C: stopping at the end of this step") == 1
    assert "Traceback" not in result.stderr
    assert saved_step(tmp_path) == 3


def test_a_second_ctrl_c_stops_at_once_without_saving_a_broken_step(tmp_path, small_vocab):
    result = fit(tmp_path, small_vocab, *signal_at(3, "SIGINT", times=2))
    assert result.returncode == 130, result.stderr[-3000:]
    (line,) = error_lines(result)
    assert "stopped by SIGINT at step 2 " in line and "no checkpoint was written" in line, line
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()


def test_sigterm_to_one_of_two_ranks_stops_both_at_the_same_step(tmp_path, small_vocab):
    """DDP over two CPU ranks, SIGTERM to rank 1 alone (as when a scheduler's signals reach the
    ranks in different steps): both stop at the step after it, together, save it, exit 143.
    (Lightning 2.6's own per-step broadcast stops rank 1 alone here and rank 0 waits for it in
    the next all-reduce: distributed.AgreedStop.)"""
    ddp = ["--config", "configs/ddp.yaml", "--trainer.accelerator", "cpu", "--trainer.devices", "2",
           "--data.batch_size", "2"]
    result = fit(tmp_path, small_vocab, *ddp, *signal_at(3, "SIGTERM", rank=1))
    assert result.returncode == 143, result.stderr[-3000:]
    assert [line.split(" (")[0] for line in error_lines(result)] == [
        "error: stopped by SIGTERM at step 4"], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert saved_step(tmp_path) == 4


def test_a_killed_run_leaves_no_loader_worker_behind(tmp_path, small_vocab):
    """SIGKILL gives the trainer no chance to stop its loader workers (they start from a
    forkserver, not as its forked children): they end with it. The run's output pipe reaches its
    end only once nothing of the run holds it."""
    cmd = [sys.executable, "-m", "fp8_lightning", "fit", "--config", "configs/quickstart.yaml",
           *small_vocab, "--trainer.max_steps", "1000", "--trainer.log_every_n_steps", "1",
           "--trainer.default_root_dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step 3 |"):
            break
    proc.kill()
    assert proc.wait(timeout=30) == -9, "".join(seen[-20:])
    proc.communicate(timeout=60)  # TimeoutExpired: a worker outlived the run
