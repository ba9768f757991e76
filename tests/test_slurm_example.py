"""examples/slurm_fit.sbatch, on the CPU: the directives ask one task per GPU, the srun line is
what it runs, and Lightning's SLURM detection turns each task's environment (as SLURM sets it)
into that task's ranks of a 2 x 8 FSDP2 run. No cluster runs it here."""

import os
import random
import re
import subprocess
import sys

import numpy
import pytest
import torch

from tests._runs import ROOT

SCRIPT = ROOT / "examples" / "slurm_fit.sbatch"


def directives() -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", SCRIPT.read_text(), re.M))


def srun_argv(tmp_path, nodes: str, per_node: str) -> list[str]:
    """The script run by bash as sbatch would start it (its variables from the directives), srun
    stood in for: the command line srun would start on every task."""
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "srun"
    fake.write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$SRUN_ARGS"\n')
    fake.chmod(0o755)
    out = tmp_path / "srun_args.txt"
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", SRUN_ARGS=str(out),
               SLURM_JOB_NUM_NODES=nodes, SLURM_NTASKS_PER_NODE=per_node,
               SLURM_CPUS_PER_TASK="8")
    done = subprocess.run(["bash", str(SCRIPT), "data/text-8k"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return out.read_text().splitlines()


def test_the_directives_ask_one_task_per_gpu():
    d = directives()
    assert d["nodes"] == "2" and d["ntasks-per-node"] == d["gpus-per-node"] == "8"


def test_the_script_needs_a_dataset(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30,
                          env=dict(os.environ, SLURM_JOB_NUM_NODES="2", SLURM_NTASKS_PER_NODE="8"))
    assert done.returncode == 2 and done.stderr == (
        "error: no dataset; usage: sbatch examples/slurm_fit.sbatch DATA_DIR\n")


@pytest.mark.parametrize("node, local", [(0, 0), (1, 7)])
def test_each_task_s_slurm_environment_gives_its_ranks_of_the_run(tmp_path, monkeypatch, node,
                                                                  local):
    from lightning.pytorch.utilities import rank_zero_only

    from fp8_lightning.cli import ArgumentParser, FP8LightningCLI
    from fp8_lightning.data.streaming import TokenShardDataModule
    from fp8_lightning.module import GPTLightningModule

    d = directives()
    nodes, per_node = int(d["nodes"]), int(d["ntasks-per-node"])
    argv = srun_argv(tmp_path, str(nodes), str(per_node))
    assert argv[:5] == [f"--cpus-per-task={d['cpus-per-task']}", "python", "-m", "fp8_lightning",
                        "fit"]
    rank = node * per_node + local
    # Lightning writes the task's rank into the process-wide rank_zero_only (a later test in this
    # worker would log nothing) and the rendezvous and seed into os.environ (a later gloo test
    # would dial gpu01): recorded here, put back after the test.
    monkeypatch.setattr(rank_zero_only, "rank", rank_zero_only.rank)
    for key in ("MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    # what srun sets for the task on `node` with local rank `local` (Lightning reads these)
    for key, value in dict(SLURM_NTASKS=nodes * per_node, SLURM_NTASKS_PER_NODE=per_node,
                           SLURM_JOB_NUM_NODES=nodes, SLURM_NNODES=nodes, SLURM_NODEID=node,
                           SLURM_PROCID=rank, SLURM_LOCALID=local, SLURM_JOB_ID=4242,
                           SLURM_JOB_NAME=d["job-name"], SLURM_NODELIST="gpu[01-02]").items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.setattr(sys, "argv", ["fp8_lightning"])  # the args are given, not sys.argv
    # (the config's seed_everything reseeds the process's generators: put back after)
    states = random.getstate(), numpy.random.get_state()
    with torch.random.fork_rng():
        cli = FP8LightningCLI(GPTLightningModule, TokenShardDataModule,
                              parser_class=ArgumentParser, run=False,
                              args=argv[5:] + ["--trainer.accelerator", "cpu"])
    random.setstate(states[0])
    numpy.random.set_state(states[1])
    trainer = cli.trainer
    environment = trainer.strategy.cluster_environment
    assert type(environment).__name__ == "SLURMEnvironment"
    assert type(trainer.strategy).__name__ == "FSDP2Strategy"
    # HSDP by default on several nodes: a replica per node, sharded over its GPUs
    assert (trainer.strategy.replicas, trainer.strategy.shards) == (nodes, per_node)
    assert (trainer.world_size, trainer.global_rank, trainer.node_rank, trainer.local_rank) == (
        nodes * per_node, rank, node, local)
    assert environment.main_address == "gpu01"  # the first node of the list, on every task
    assert cli.model.config.name == "llama3-8b"
