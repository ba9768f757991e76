"""Several processes on the CPU (gloo): DDP through the CLI and the shipped config, a torchrun
launch (the resume of the DDP run), one process emulating two ranks, and the NaN guard's
cross-rank decision. FSDP2: tests/test_fsdp2.py.

The fits train on a small vocabulary (the ``small_vocab`` fixture) and without loader workers
(``fit_ranks``): the point is the processes, not the tokenizer or the data loader's processes."""

from pathlib import Path

import pytest

from fp8_lightning.checkpoint_files import load_checkpoint_file
from tests._runs import (BATCH, ROOT, TOKENS_PER_STEP, fit_ranks, rank_layouts, rank_settings,
                         run_main)


def digests(path):
    return {p.name: p.read_text() for p in sorted(Path(path).glob("rank*.txt"))}


def samples_per_step(path):
    """What ``tests.helpers.BatchLog`` wrote (every rank into the same file): each optimizer
    step's sample hashes, sorted."""
    import json

    steps = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        steps.setdefault(row["step"], []).extend(row["samples"])
    return {step: sorted(s) for step, s in steps.items()}


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory, small_vocab):
    """Two DDP fits on two CPU processes, each process launch shared by several tests: a 6-step
    run that Lightning starts (a fault on rank 1 at step 2; every rank's batches logged), and its
    resume to step 9 started as two nodes of one process on this host (a torchrun per node, a
    c10d rendezvous: the multi-node launch of docs/several-gpus.md)."""
    root = tmp_path_factory.mktemp("ddp")
    first = fit_ranks(root, small_vocab, "--trainer.max_steps", "6",
                      "--trainer.callbacks+=fp8_lightning.FaultInjection",
                      "--trainer.callbacks.kind", "grad", "--trainer.callbacks.steps", "[2]",
                      "--trainer.callbacks.ranks", "[1]",
                      "--trainer.callbacks+=tests.helpers.RankDigest",
                      "--trainer.callbacks.path", str(root / "digest1"),
                      "--trainer.callbacks+=tests.helpers.BatchLog",
                      "--trainer.callbacks.path", str(root / "batches.jsonl"),
                      config="configs/ddp.yaml")
    second = fit_ranks(root, small_vocab, "--trainer.max_steps", "9", "--ckpt_path", "last",
                       "--trainer.callbacks+=tests.helpers.RankDigest",
                       "--trainer.callbacks.path", str(root / "digest2"),
                       "--trainer.callbacks+=tests.helpers.StrategySettings",
                       "--trainer.callbacks.path", str(root / "settings"),
                       config="configs/ddp.yaml", torchrun=True, nodes=2)
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


def test_a_two_node_torchrun_launch_is_picked_up_by_lightning(ddp_runs):
    """The multi-node launch of the docs as two nodes of one process on this host (the fixture's
    resumed run): a torchrun per node starts its process, they meet at the c10d rendezvous, and
    Lightning takes rank, node and world size from their environment (it spawns none of its
    own): two ranks, one per node, whose every step counts both."""
    root, _, second = ddp_runs
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in second
    layouts = rank_layouts(root)
    assert sorted(layout["node_rank"] for layout in layouts) == [0, 1]
    assert all(layout["num_nodes"] == 2 and layout["local_rank"] == 0 and
               layout["world_size"] == 2 for layout in layouts)
    ckpt = load_checkpoint_file(root / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 9 and ckpt["tokens_seen"] == 9 * TOKENS_PER_STEP * 2
    assert len(digests(root / "digest2")) == 2  # two processes, not 2 x 2


def test_one_process_emulating_two_ranks_sees_exactly_the_ddp_samples(ddp_runs, tmp_path,
                                                                      small_vocab, capsys):
    """data.emulate_ranks: the single-device reference for a multi-GPU run reads, at every
    optimizer step, the very samples the ranks of that run read (so their losses can be compared;
    here the fixture's first DDP run, two ranks of BATCH samples). The one-process fits run in
    this process: the data order is under test, not the launch."""
    ddp = samples_per_step(ddp_runs[0] / "batches.jsonl")
    log = fit_ranks(tmp_path / "one", small_vocab, "--trainer.max_steps", "6",
                    "--trainer.callbacks+=tests.helpers.BatchLog", "--trainer.callbacks.path",
                    str(tmp_path / "one.jsonl"), "--data.emulate_ranks", "2",
                    "--trainer.accumulate_grad_batches", "2", capsys=capsys)
    assert "emulating 2 data-parallel ranks" in log
    one = samples_per_step(tmp_path / "one.jsonl")
    assert sorted(ddp) == sorted(one) == [0, 1, 2, 3, 4, 5]
    assert all(len(ddp[s]) == 2 * BATCH for s in ddp)  # 2 ranks x BATCH
    assert ddp == one
    # A normal run (no emulation) reads another order: the comparison above is not vacuous.
    fit_ranks(tmp_path / "plain", small_vocab, "--trainer.max_steps", "6", "--data.batch_size",
              str(2 * BATCH), "--trainer.callbacks+=tests.helpers.BatchLog",
              "--trainer.callbacks.path", str(tmp_path / "plain.jsonl"), capsys=capsys)
    assert samples_per_step(tmp_path / "plain.jsonl") != ddp


def test_emulate_ranks_needs_matching_accumulation(tmp_path, small_vocab, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, _, err = run_main(capsys, ["fit", "--config", "configs/quickstart.yaml", *small_vocab,
                                     "--trainer.max_steps", "1", "--trainer.default_root_dir",
                                     str(tmp_path), "--data.emulate_ranks", "2"])
    assert code == 2
    assert "data.emulate_ranks=2 needs trainer.accumulate_grad_batches=2" in err
