"""HSDP (``FSDP2Strategy(replicate=N)``) on CPU processes (gloo): the option and its default, the
2-D mesh and its groups, the FP8 reduction groups, data sharding over two node ranks, and a
sharded checkpoint resumed across layouts (HSDP 2x2 -> FSDP2 on 4 -> one file through
``consolidate``). Two GPUs: tests/test_gpu_ddp.py.

The four ranks fork from one fresh process that has imported what they need (four spawned ranks
would each cost seconds of imports on a small CPU) and each runs its Trainer fits in its own
process, in the environment torchrun gives two nodes of two processes: the strategy's own mesh,
checkpoint and load paths are under test, not the CLI's start-up."""

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fp8_lightning.config import ConfigError, GPTConfig
from fp8_lightning.device_mesh import replica_problems, replicas
from fp8_lightning.distributed import FSDP2Strategy

CONFIG = GPTConfig(name="tiny", n_layer=2, vocab_size=512)  # 16-aligned for torchao's float8
SAMPLES, BATCH = 32, 2  # the data: sample i starts with token i


def test_replicate_defaults_to_one_replica_per_node_and_is_checked():
    """``replicate: null`` is a replica per node (plain FSDP2 on one node); a value that is no
    integer >= 1, or that does not divide the world size, is one line each, saying what is
    valid; all problems of the strategy's arguments come in one error."""
    assert replicas(None, 1) == 1 and replicas(None, 2) == 2 and replicas(1, 4) == 1
    assert replica_problems(None, 8) == [] and replica_problems(2, 4) == []
    assert replica_problems(3, 4) == ["replicate=3 does not divide the world size 4 (devices x "
                                      "num_nodes); valid: 1, 2, 4"]
    with pytest.raises(ConfigError) as error:
        FSDP2Strategy(replicate=0, param_dtype="float16")
    assert error.value.problems == [
        "replicate=0; valid: null (one replica per node), 1 (plain FSDP2) or an integer >= 1 "
        "that divides the world size", "param_dtype='float16'; valid: bfloat16, float32"]
    for bad in (True, 1.5, "2"):
        assert len(replica_problems(bad)) == 1, bad


def test_the_memory_estimate_divides_by_a_replica_groups_ranks():
    """Under HSDP the training state is split over the ranks of a replica group, not the world:
    the memory check's shard count; where it does not fit, sharding over every GPU is the lever."""
    from types import SimpleNamespace

    from fp8_lightning.memory import GIB, RunShape, estimate_memory, fit_problem
    from fp8_lightning.memory_check import shard_count

    hsdp, plain = FSDP2Strategy(), FSDP2Strategy(replicate=1)
    for strategy in (hsdp, plain):
        strategy.parallel_devices, strategy.num_nodes = [torch.device("cpu")] * 2, 2
    assert (hsdp.replicas, hsdp.shards, plain.shards) == (2, 2, 4)
    assert shard_count(SimpleNamespace(strategy=hsdp, world_size=4)) == 2
    assert shard_count(SimpleNamespace(strategy=plain, world_size=4)) == 4
    assert shard_count(SimpleNamespace(strategy=object(), world_size=4)) == 1  # DDP
    config = GPTConfig.from_name("llama3-8b")
    run = RunShape(1, 8192, fp8=True, shards=2, activation_checkpointing="full")
    budget = estimate_memory(config, run).total * 0.8
    problem = fit_problem(config, run, budget, gpus=4, several_nodes=True)
    assert "FSDP2 over all 4 GPUs, one replica (trainer.strategy.init_args.replicate: 1)" \
        in problem, problem
    # more GPUs than there are: on several nodes they shard only with replicate: 1 too
    small = estimate_memory(config, replace(run, shards=16)).total * 1.01
    problem = fit_problem(config, replace(run, shards=4), small, gpus=4, several_nodes=True)
    assert "FSDP2 over 16 GPUs (--config configs/fsdp.yaml; trainer.devices x trainer.num_nodes" \
        " = 16, trainer.strategy.init_args.replicate: 1)" in problem, problem
    # one node: replicate's default shards over every GPU already
    assert "replicate" not in fit_problem(config, replace(run, shards=4), small, gpus=4)


def _seen(record: dict, key: str):
    """A callback that puts into ``record[key]`` what a rank's fit had: its mesh and groups, the
    FP8 plugin's amax group, the sampler's split, the weights it started from (full), the
    samples of each step and the float8 weight scales of each optimizer step."""
    import lightning as L
    import torch.distributed as dist

    from fp8_lightning.distributed import full_tensor

    class Seen(L.Callback):
        def on_train_start(self, trainer, module):
            strategy = trainer.strategy
            mesh = strategy.fsdp2_mesh
            record[key] = {
                "shape": tuple(mesh.shape), "names": mesh.mesh_dim_names,
                "groups": {name: dist.get_process_group_ranks(mesh.get_group(name))
                           for name in mesh.mesh_dim_names},
                "amax_group": dist.get_process_group_ranks(trainer.precision_plugin._amax_group),
                "sampler": strategy.distributed_sampler_kwargs,
                "placements": [str(p) for p in module.model.blocks[0].qkv.weight.placements],
                "start_step": trainer.global_step,
                "weights": {n: full_tensor(p.detach()).clone()
                            for n, p in module.model.named_parameters()},
                "samples": {}, "scales": []}

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            record[key]["samples"][trainer.global_step] = batch[:, 0].tolist()

        def on_before_optimizer_step(self, trainer, module, optimizer):
            record[key]["scales"].append([float(getattr(w, "_local_tensor", w)._precomputed_scale)
                                          for w in trainer.strategy._float8_weights])

    return Seen()


def hsdp_rank(rank: int, port: int, root: str) -> None:
    """One of four ranks, two nodes of two (torchrun's environment): an HSDP fit (replicate
    null: a replica per node, 2x2) with float8 all-gather (torchao tensorwise) that saves a
    sharded checkpoint, then a plain FSDP2 fit over the four ranks resumed from it; what each
    saw into ``rank<N>.pt``."""
    import lightning as L
    import torch.distributed as dist

    from fp8_lightning.distributed import full_tensor
    from fp8_lightning.fp8 import FP8Precision, torchao_engine
    from fp8_lightning.module import GPTLightningModule

    # torchao's float8 GEMMs run on a CPU; only the engine's hardware check is told yes
    torchao_engine.TorchaoEngine.available = lambda self, recipe: (True, "CPU (check skipped)")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="4", LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2",
                      GROUP_RANK=str(rank // 2), TORCHELASTIC_RUN_ID="hsdp-test")
    record, root = {}, Path(root)
    data = torch.randint(0, 512, (SAMPLES, 33), generator=torch.Generator().manual_seed(0))
    data[:, 0] = torch.arange(SAMPLES)  # which sample a rank read
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)

    def fit(key, steps, ckpt=None, **strategy):
        torch.manual_seed(0)
        module = GPTLightningModule(config=CONFIG, backend="torch", compile=False,
                                    warmup_steps=1, lr_decay_steps=10)
        trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=2, num_nodes=2,
                            strategy=FSDP2Strategy(process_group_backend="gloo", **strategy),
                            plugins=[FP8Precision(recipe="tensorwise", fp8_layers="all")],
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0,
                            callbacks=[_seen(record, key)], default_root_dir=root)
        trainer.fit(module, loader, ckpt_path=ckpt)
        trainer.save_checkpoint(root / f"{key}.ckpt")
        record[key].update(end_step=trainer.global_step, end_weights={
            n: full_tensor(p.detach()).clone() for n, p in module.model.named_parameters()})

    fit("hsdp", 2, float8_all_gather=True)
    fit("fsdp", 3, ckpt=root / "hsdp.ckpt", replicate=1)
    torch.save(record, root / f"rank{rank}.pt")
    dist.barrier()  # every rank past its last collective before gloo's threads go
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def hsdp_ranks(tmp_path_factory):
    """:func:`hsdp_rank` on four ranks; each rank's record, and the run directory."""
    from tests._runs import forked_ranks

    pytest.importorskip("torchao")
    root = tmp_path_factory.mktemp("hsdp")
    forked_ranks(hsdp_rank, 4, root, preload=("lightning.pytorch", "torchao.float8",
                                              "fp8_lightning.module"))
    return [torch.load(root / f"rank{r}.pt") for r in range(4)], root


def test_hsdp_mesh_is_replicas_by_shards_with_the_fp8_reductions_over_every_rank(hsdp_ranks):
    """Two nodes of two ranks, ``replicate: null``: a 2x2 (replicate, shard) mesh whose shard
    groups are a node's ranks and replicate groups one rank of each node; parameters replicated
    across replicas and sharded within one; delayed scaling's amax group is the world (every
    rank its own data; replicas must quantise alike), and torchao's float8 weight scales, reduced
    over a shard group, are the same on every rank at every step."""
    records, _ = hsdp_ranks
    for rank, record in enumerate(records):
        seen = record["hsdp"]
        assert seen["shape"] == (2, 2) and seen["names"] == ("replicate", "shard")
        assert seen["groups"] == {"replicate": [rank % 2, rank % 2 + 2],
                                  "shard": [rank // 2 * 2, rank // 2 * 2 + 1]}
        assert seen["placements"] == ["R", "S(0)"]
        assert seen["amax_group"] == [0, 1, 2, 3]
        plain = record["fsdp"]
        assert plain["shape"] == (4,) and plain["placements"] == ["S(0)"]
        assert plain["amax_group"] == [0, 1, 2, 3]
    scales = [r["hsdp"]["scales"] for r in records]
    assert len(scales[0]) == 2 and len(scales[0][0]) == 2 * 4  # 2 steps, 4 GEMMs a block
    assert all(s == scales[0] for s in scales), scales
    # ... and the replicas stayed the same model: each rank's gather (its replica's shards)
    for record in records[1:]:
        ends = record["hsdp"]["end_weights"]
        assert all(torch.equal(ends[n], w) for n, w in records[0]["hsdp"]["end_weights"].items())


def test_hsdp_splits_the_data_over_every_rank_of_both_nodes(hsdp_ranks):
    """The sampler's world is all four ranks, not a replica group: each step the four ranks read
    four disjoint micro-batches, under HSDP as under plain FSDP2."""
    records, _ = hsdp_ranks
    for key in ("hsdp", "fsdp"):
        assert [r[key]["sampler"] for r in records] == [
            {"num_replicas": 4, "rank": rank} for rank in range(4)]
        for step in records[0][key]["samples"]:
            read = [s for r in records for s in r[key]["samples"][step]]
            assert len(read) == 4 * BATCH and len(set(read)) == 4 * BATCH, (key, step, read)


def test_an_hsdp_checkpoint_resumes_under_plain_fsdp2_and_consolidates_to_one_file(
        hsdp_ranks, tmp_path):
    """HSDP 2x2 -> FSDP2 on 4 -> one file: the sharded checkpoint of the HSDP fit loads into
    the 1-D mesh of four (its weights, step and optimizer state), trains on, and that run's
    checkpoint consolidates into one file that loads into an unsharded model; the HSDP directory
    consolidates directly too."""
    from fp8_lightning.checkpoint_files import load_checkpoint_file
    from fp8_lightning.cli import main
    from fp8_lightning.module import GPTLightningModule

    records, root = hsdp_ranks
    saved = records[0]["hsdp"]["end_weights"]
    for record in records:
        assert record["hsdp"]["end_step"] == 2 and record["fsdp"]["start_step"] == 2
        assert record["fsdp"]["end_step"] == 3
        resumed = record["fsdp"]["weights"]
        assert resumed.keys() == saved.keys()
        assert all(torch.equal(resumed[n], saved[n]) for n in saved)
    for key in ("hsdp", "fsdp"):
        out = tmp_path / f"{key}.ckpt"
        main(["consolidate", str(root / f"{key}.ckpt"), str(out)])
        ckpt = load_checkpoint_file(out)
        assert ckpt["global_step"] == records[0][key]["end_step"]
        module = GPTLightningModule(config=CONFIG, backend="torch", lr_decay_steps=10)
        module.configure_model()
        module.load_state_dict(ckpt["state_dict"])
        for name, p in module.model.named_parameters():
            assert torch.equal(p.detach(), records[0][key]["end_weights"][name]), (key, name)
        optimizer = module.configure_optimizers()["optimizer"]
        optimizer.load_state_dict(ckpt["optimizer_states"][0])
        assert all(int(optimizer.state[p]["step"]) == ckpt["global_step"]
                   for g in optimizer.param_groups for p in g["params"])
