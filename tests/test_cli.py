import re
from pathlib import Path

import pytest
import torch

from fp8_lightning.te_availability import fallback_precision
from tests._runs import ROOT, run_cli, run_main




def scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = Path(run_dir).rglob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory, small_vocab):
    """30 steps of the quickstart on a small vocabulary (its GPT-2 one makes a step ~50x slower
    on a CPU); the README's own commands run the GPT-2 data (tests/test_readme.py)."""
    out = tmp_path_factory.mktemp("quickstart")
    result = run_cli("fit", "--config", "configs/quickstart.yaml", *small_vocab,
                     "--trainer.max_steps", "30",
                     "--trainer.val_check_interval", "15", "--trainer.log_every_n_steps", "5",
                     "--trainer.default_root_dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


def test_quickstart_fit_writes_checkpoint_and_tensorboard(quickstart_run):
    out, result = quickstart_run
    (ckpt,) = out.rglob("last.ckpt")
    checkpoint = torch.load(ckpt, weights_only=True)  # plain types only: safe to load
    assert checkpoint["global_step"] == 30
    # no GPU/TE here: the fastest precision this machine has, and says so
    assert checkpoint["fp8_lightning"]["precision"] == ("fp32" if fallback_precision()[0] == "32-true" else "bf16")
    assert checkpoint["tokens_seen"] == 30 * 8 * 128
    assert "FP8 is not available:" in result.stderr
    tags = scalars(out)
    assert {"train/loss", "val/loss", "val/ppl"} <= set(tags)


def test_quickstart_loss_falls(quickstart_run):
    out, _ = quickstart_run
    loss = scalars(out)["train/loss"]
    assert len(loss) >= 6
    assert loss[-1] < loss[0] - 1.5, loss  # from ~5.5 (uniform over 257 tokens) clearly down




def test_print_config_and_dotted_overrides(capsys):
    code, out, err = run_main(capsys, ["fit", "--config", str(ROOT / "configs/gpt2_fp8.yaml"),
                              "--model.config.n_layer", "3", "--print_config"])
    assert code == 0, err
    assert "n_layer: 3" in out and "fp8_lightning.FP8Precision" in out
    assert "recipe:\n        name: delayed\n        amax_history_len: 1\n" in out


@pytest.mark.parametrize("value, parsed", [("1", "1"), ("2", "2"), ("1.0", "1.0"), ("0.25", "0.25")])
def test_a_whole_number_of_batches_stays_a_count_and_a_fraction_a_share(capsys, value, parsed):
    """Lightning reads limit_val_batches 1 as one batch and 1.0 as all of them: the CLI keeps the
    type the user wrote (jsonargparse tries the Trainer's int before its float)."""
    code, out, err = run_main(capsys, ["fit", "--config", str(ROOT / "configs/quickstart.yaml"),
                                       "--trainer.limit_val_batches", value, "--print_config"])
    assert code == 0, err
    assert f"limit_val_batches: {parsed}\n" in out


def test_user_errors_are_one_message_without_traceback():
    result = run_cli("fit", "--config", "configs/quickstart.yaml", "--model.config.n_embd", "100",
                     "--trainer.max_steps", "1")
    assert result.returncode != 0
    assert "n_embd=100 is not a multiple of 16" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_recipe_key_is_rejected(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text((ROOT / "configs/gpt2_fp8.yaml").read_text().replace(
        "        weights: bf16-mixed", "        interval: 1\n        weights: bf16-mixed"))
    code, _, err = run_main(capsys, ["fit", "--config", str(cfg), "--print_config"])
    assert code != 0 and "interval" in err


def test_readme_commands_match_ci():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = next(line for line in ci.splitlines() if "pytest" in line).strip()
    assert test_cmd in readme
    assert "python -m fp8_lightning fit --config configs/quickstart.yaml" in readme


def test_resuming_a_finished_run_says_how_to_continue(quickstart_run, small_vocab):
    """`--ckpt_path last` on a run already at trainer.max_steps trains nothing (Lightning says
    nothing): one warning names the step and the override that continues it; the checkpoint
    stays as it was."""
    out, _ = quickstart_run
    (ckpt,) = out.rglob("last.ckpt")
    before = ckpt.stat().st_mtime_ns
    result = run_cli("fit", "--config", "configs/quickstart.yaml", *small_vocab,
                     "--trainer.max_steps", "30", "--trainer.default_root_dir", str(out),
                     "--ckpt_path", "last")
    assert result.returncode == 0, result.stderr[-3000:]
    # a sentence after WARNING:, not after a path into the package's source
    assert re.search(r"^WARNING: the checkpoint is at step 30 and trainer\.max_steps=30: nothing "
                     r"left to train\. To continue, raise it, e\.g\. --trainer\.max_steps 60",
                     result.stderr, re.M), result.stderr[-3000:]
    assert not re.search(r"\.py:\d+: ", result.stderr), result.stderr[-3000:]
    assert ckpt.stat().st_mtime_ns == before
