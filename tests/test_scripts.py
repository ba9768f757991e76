"""The maintainers' scripts: how ``scripts/gpu_tests.sh`` spreads the GPU suite over a machine's
GPUs (python stood in for), ``scripts/memprobe.py``'s summary and input checks, and
``benchmarks/plain_pytorch.py``'s. The benchmark harness has its own: tests/test_harness.py."""

import os
import re
import subprocess
import sys

import pytest

from tests._runs import ROOT, load_script


def stand_in_python(tmp_path, record, gpus="4", pause="", two_pause=""):
    """A stand-in for python that the GPU scripts call: it answers ``device_count`` with
    ``gpus`` and appends ``record`` (shell words, e.g. ``$CUDA_VISIBLE_DEVICES|$*``) to
    ``$CALLS`` for every other call, then sleeps ``pause`` seconds where given (``two_pause``
    for a two-GPU test: shorter, so that a pair is done while one-GPU files are left)."""
    fake = tmp_path / "python"
    sleep = (f'; case "$*" in *test_gpu_ddp.py*) sleep {two_pause or pause};; *) sleep {pause};; '
             "esac") if pause else ""
    fake.write_text(f'#!/bin/bash\ncase "$*" in *device_count*) echo "{gpus}"; exit 0;; esac\n'
                    f'echo "{record}" >> "$CALLS"' + sleep + "\n")
    fake.chmod(0o755)
    return fake


def test_gpu_tests_spread_the_suite_over_the_gpus_and_run_every_test_once(tmp_path):
    """scripts/gpu_tests.sh with a stand-in for python that records each pytest it is given: each
    pair of GPUs takes the two-GPU tests (a pytest per test function), then its GPUs take one-GPU
    files (a pytest per file), as does a GPU without a pair; every GPU test file runs, the
    two-GPU file once per test function; past DEADLINE nothing starts and what is left is
    listed."""
    # a pytest takes a moment, so that every GPU gets work (a two-GPU test a shorter one: with
    # three GPUs the pair must be done while the unpaired GPU has files left)
    fake = stand_in_python(tmp_path, "$CUDA_VISIBLE_DEVICES|$*", gpus="$NG", pause="0.3",
                           two_pause="0.05")
    two = "tests/test_gpu_ddp.py"
    functions = re.findall(r"^def (test_\w+)", (ROOT / two).read_text(), re.M)
    files = sorted(p.relative_to(ROOT).as_posix()
                   for p in [*ROOT.glob("tests/test_gpu*.py"), ROOT / "tests/test_notebook.py"]
                   if p.name != "test_gpu_ddp.py")

    def suite(n, **env):
        calls = tmp_path / f"calls{n}{env}.txt"
        result = subprocess.run(
            ["bash", str(ROOT / "scripts" / "gpu_tests.sh"), "-k", "not slow"],
            env=dict(os.environ, NG=str(n), CALLS=str(calls), PYTHON=str(fake),
                     OUT=str(tmp_path / f"out{n}"), **env), capture_output=True, text=True,
            timeout=60)
        lines = calls.read_text().splitlines() if calls.exists() else []
        assert all("-m gpu" in line and line.endswith("-k not slow") for line in lines)
        runs = [(gpus, [a for a in args.split() if a.startswith("tests/")])
                for gpus, args in (line.split("|") for line in lines)]
        assert all(len(ran) == 1 for _, ran in runs)  # a pytest per test or file
        return result, [(gpus, ran[0]) for gpus, ran in runs]

    for n, pairs, singles in ((4, {"0,1", "2,3"}, {"0", "1", "2", "3"}), (3, {"0,1"}, {"0", "1", "2"})):
        result, runs = suite(n)
        assert result.returncode == 0, result.stdout
        assert sorted(ran for gpus, ran in runs if "," in gpus) == sorted(
            f"{two}::{f}" for f in functions)
        assert {gpus for gpus, _ in runs if "," in gpus} == pairs
        assert {gpus for gpus, _ in runs if "," not in gpus} == singles
        assert sorted(ran for gpus, ran in runs if "," not in gpus) == files
    # FILES " " (none): the two-GPU tests alone; TWO_TESTS " ": the one-GPU files alone
    result, runs = suite(2, FILES=" ")
    assert result.returncode == 0 and sorted(ran for _, ran in runs) == sorted(
        f"{two}::{f}" for f in functions)
    result, runs = suite(2, TWO_TESTS=" ")
    assert result.returncode == 0 and sorted(ran for _, ran in runs) == files
    result, runs = suite(2, DEADLINE="0")
    assert runs == [] and result.returncode != 0
    assert result.stdout.split("not run (DEADLINE):")[1].split() == \
        [f"{two}::{f}" for f in functions] + sorted(files, key=lambda f: -(ROOT / f).stat().st_size)


def test_the_memory_probe_groups_live_blocks_by_where_they_were_made():
    """scripts/memprobe.py's summary of a memory snapshot: only live blocks count, grouped by
    the innermost telling frame and the package frame that called it, largest first."""
    probe = load_script("scripts/memprobe.py")

    def frames(*where):
        return [{"filename": f, "line": n, "name": name} for f, n, name in where]

    mlp = frames(("/x/transformer_engine/pytorch/module/layernorm_mlp.py", 500, "forward"),
                 ("/x/fp8_lightning/model.py", 150, "residual"))
    head = frames(("/x/torch/nn/functional.py", 10, "linear"), ("/x/fp8_lightning/model.py", 300,
                                                                  "forward"))
    gib = probe.GIB
    snapshot = {"segments": [{"blocks": [
        {"state": "active_allocated", "size": gib, "frames": mlp},
        {"state": "active_allocated", "size": gib, "frames": mlp},
        {"state": "inactive", "size": 5 * gib, "frames": mlp},
        {"state": "active_allocated", "size": gib // 2, "frames": head}]}]}
    lines = probe.summary(snapshot, "out of memory").splitlines()
    assert lines[0] == "out of memory: 2.50 GiB live in 3 blocks"
    assert lines[2].split() == ["2.000", "2", "transformer_engine:pytorch/module/layernorm_mlp.py:500",
                                "forward", "<-", "fp8_lightning:model.py:150", "residual"]
    assert lines[3].split()[:3] == ["0.500", "1", "fp8_lightning:model.py:300"]


@pytest.mark.parametrize("fraction", ["abc", "0", "1.5"])
def test_the_memory_probe_refuses_a_share_of_the_gpu_it_cannot_take(fraction):
    result = subprocess.run([sys.executable, "scripts/memprobe.py", "-m", "json.tool", "--help"],
                            cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "MEMPROBE_FRACTION": fraction})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (f"error: MEMPROBE_FRACTION={fraction}; valid: a number in "
                                     "(0, 1]")


def test_the_plain_script_refuses_a_depth_or_checkpointing_it_cannot_run():
    """benchmarks/plain_pytorch.py --n_layer 0 or an unknown --activation_checkpointing: exit
    2 with an error line naming the flag, before any GPU work."""
    for bad in (["--n_layer", "0"], ["--activation_checkpointing", "some"]):
        result = subprocess.run([sys.executable, "benchmarks/plain_pytorch.py", *bad], cwd=ROOT,
                                capture_output=True, text=True, timeout=120)
        errors = [line for line in result.stderr.splitlines() if "error:" in line]
        assert result.returncode == 2 and len(errors) == 1 and bad[0] in errors[0], result.stderr
        assert "Traceback" not in result.stderr
