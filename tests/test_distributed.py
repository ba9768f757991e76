"""Several processes on the CPU (gloo): DDP through the CLI and the shipped config, a torchrun
launch, one process emulating two ranks, and the NaN guard's cross-rank decision. FSDP2:
tests/test_fsdp2.py.

The fits train on a small vocabulary (the ``small_vocab`` fixture): the point is the processes,
not the tokenizer."""

from pathlib import Path

import pytest

from fp8_lightning.checkpoint import load_checkpoint_file
from tests._runs import BATCH, ROOT, TOKENS_PER_STEP, fit_ranks, rank_settings, run_main


def digests(path):
    return {p.name: p.read_text() for p in sorted(Path(path).glob("rank*.txt"))}


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory, small_vocab):
    root = tmp_path_factory.mktemp("ddp")
    first = fit_ranks(root, small_vocab, "--trainer.max_steps", "6",
                      "--trainer.callbacks+=fp8_lightning.FaultInjection",
                      "--trainer.callbacks.kind", "grad", "--trainer.callbacks.steps", "[2]",
                      "--trainer.callbacks.ranks", "[1]",
                      "--trainer.callbacks+=tests.helpers.RankDigest",
                      "--trainer.callbacks.path", str(root / "digest1"), config="configs/ddp.yaml")
    second = fit_ranks(root, small_vocab, "--trainer.max_steps", "9", "--ckpt_path", "last",
                       "--trainer.callbacks+=tests.helpers.RankDigest",
                       "--trainer.callbacks.path", str(root / "digest2"),
                       "--trainer.callbacks+=tests.helpers.StrategySettings",
                       "--trainer.callbacks.path", str(root / "settings"),
                       config="configs/ddp.yaml")
    return root, first, second


def test_ddp_one_ranks_bad_gradient_makes_every_rank_skip(ddp_runs):
    root, first, _ = ddp_runs
    # The fault is on rank 1 only; rank 0 (the one that logs) skipped the same step ...
    assert "FaultInjection: grad (nan) at step 2 on rank 1" in first
    assert "NaN guard: skipped at step 2" in first
    # ... so the replicas took the same optimizer steps and hold the same weights.
    d = digests(root / "digest1")
    assert len(d) == 2 and len(set(d.values())) == 1, d


def test_ddp_checkpoint_counts_every_rank_and_resumes_in_step(ddp_runs):
    root, _, second = ddp_runs
    assert "data: resumed at block" in second and "(verified)" in second
    ckpt = load_checkpoint_file(root / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 9
    assert ckpt["tokens_seen"] == 9 * TOKENS_PER_STEP * 2  # two ranks
    d = digests(root / "digest2")
    assert len(d) == 2 and len(set(d.values())) == 1, d


def test_ddp_applies_the_overlays_bucket_settings_on_every_rank(ddp_runs):
    """configs/ddp.yaml: gradients live in the all-reduce buckets (no copy), PyTorch's default
    25 MiB buckets, no search for unused parameters (every parameter gets a gradient)."""
    root, _, _ = ddp_runs
    ranks = rank_settings(root)
    assert len(ranks) == 2 and ranks[0] == ranks[1]
    assert ranks[0] == {"strategy": "ddp", "gradient_as_bucket_view": True, "bucket_cap_mb": 25.0,
                        "find_unused_parameters": False}


def test_torchrun_launch_is_picked_up_by_lightning(tmp_path, small_vocab):
    # The multi-node recipe of the README, on one node: torchrun starts the processes and
    # Lightning takes rank and world size from its environment (it does not spawn its own).
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
         "-m", "fp8_lightning", "fit", "--config", "configs/quickstart.yaml",
         "--config", "configs/ddp.yaml", *small_vocab, "--trainer.accelerator", "cpu",
         "--trainer.devices", "2",
         "--trainer.num_nodes", "1", "--trainer.max_steps", "3", "--trainer.limit_val_batches", "0",
         "--data.batch_size", str(BATCH),
         "--trainer.log_every_n_steps", "3", "--trainer.default_root_dir", str(tmp_path)],
        cwd=ROOT, text=True, capture_output=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in log
    ckpt = load_checkpoint_file(tmp_path / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 3 and ckpt["tokens_seen"] == 3 * TOKENS_PER_STEP * 2


def test_one_process_emulating_two_ranks_sees_exactly_the_ddp_samples(tmp_path, small_vocab):
    """data.emulate_ranks: the single-device reference for a multi-GPU run reads, at every
    optimizer step, the very samples the ranks of that run read (so their losses can be compared)."""
    import json

    small = ["--trainer.max_steps", "4", "--data.batch_size", "4", "--data.num_workers", "1",
             "--trainer.limit_val_batches", "0", "--trainer.callbacks+=tests.helpers.BatchLog"]

    def samples_per_step(path):
        steps = {}
        for line in path.read_text().splitlines():
            row = json.loads(line)
            steps.setdefault(row["step"], []).extend(row["samples"])
        return {step: sorted(s) for step, s in steps.items()}

    fit_ranks(tmp_path / "ddp", small_vocab, *small, "--trainer.callbacks.path",
              str(tmp_path / "ddp.jsonl"), config="configs/ddp.yaml")
    log = fit_ranks(tmp_path / "one", small_vocab, *small, "--trainer.callbacks.path",
                    str(tmp_path / "one.jsonl"), "--data.emulate_ranks", "2",
                    "--trainer.accumulate_grad_batches", "2")
    assert "emulating 2 data-parallel ranks" in log
    ddp, one = samples_per_step(tmp_path / "ddp.jsonl"), samples_per_step(tmp_path / "one.jsonl")
    assert sorted(ddp) == sorted(one) == [0, 1, 2, 3]
    assert all(len(ddp[s]) == 8 for s in ddp)  # 2 ranks x 4
    assert ddp == one
    # A normal run (no emulation) reads another order: the comparison above is not vacuous.
    fit_ranks(tmp_path / "plain", small_vocab, *small[:-1], "--data.batch_size", "8",
              "--trainer.callbacks+=tests.helpers.BatchLog", "--trainer.callbacks.path",
              str(tmp_path / "plain.jsonl"))
    assert samples_per_step(tmp_path / "plain.jsonl") != ddp


def test_emulate_ranks_needs_matching_accumulation(tmp_path, small_vocab, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, _, err = run_main(capsys, ["fit", "--config", "configs/quickstart.yaml", *small_vocab,
                                     "--trainer.max_steps", "1", "--trainer.default_root_dir",
                                     str(tmp_path), "--data.emulate_ranks", "2"])
    assert code == 2
    assert "data.emulate_ranks=2 needs trainer.accumulate_grad_batches=2" in err
