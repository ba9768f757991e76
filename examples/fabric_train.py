"""Train the quickstart GPT with Lightning Fabric and the FP8 plugin; save, and resume.

    python examples/fabric_train.py --steps 20 --ckpt runs/fabric/last.ckpt
    python examples/fabric_train.py --steps 40 --ckpt runs/fabric/last.ckpt   # resumes at step 20
    python examples/fabric_train.py --devices 2 --strategy fsdp ...           # FSDP2 on two GPUs

The defaults are CPU-sized (a few seconds per 10 steps); on a GPU raise ``--batch_size`` and
``--seq_len`` (up to the preset's block size, 128 for ``tiny``) or pick a larger ``--model``.

FP8 (TransformerEngine, ``--recipe``) on an Ada/Hopper/Blackwell GPU; elsewhere BF16, or FP32 on a
CPU without BF16 instructions, with the reason in the log. The model, its optimizer (fused AdamW,
no weight decay on norms, biases and embeddings) and its learning-rate schedule are the
quickstart's (``configs/quickstart.yaml``, built by ``GPTLightningModule``); the data is the
first ``--corpus_chars`` characters of the tinyshakespeare corpus that ships with the package,
tokenized in memory. (A prepared dataset streams through ``TokenShardDataModule``:
``loader = fabric.setup_dataloaders(datamodule.train_dataloader())``, and the loader goes into
the checkpoint state too, for an exact data resume.)

The checkpoint holds the weights, the optimizer and scheduler, the FP8 plugin's state (switch
history, delayed-scaling amax histories and scales as plain tensors), the NaN guard and the step.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_only

from fp8_lightning.checkpoint_files import publish_directory
from fp8_lightning.config import GPTConfig
from fp8_lightning.data.streaming import EMBEDDED_CORPUS
from fp8_lightning.distributed import fsdp2_layout, gather_policy, shard_model
from fp8_lightning.fabric import FabricFP8Precision, FabricNaNGuard, load
from fp8_lightning.fp8 import RECIPES
from fp8_lightning.graphs import graphs_status, prepare_graphs
from fp8_lightning.module import GPTLightningModule
from fp8_lightning.tokenizer import get_tokenizer


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive, default=20,
                        help="train until this many optimizer steps in all (a resumed run counts "
                             "the checkpoint's)")
    parser.add_argument("--ckpt", default="runs/fabric/last.ckpt",
                        help="checkpoint: resumed from when it exists, saved every --save_every "
                             "steps and at the end")
    parser.add_argument("--fresh", action="store_true", help="ignore an existing --ckpt")
    parser.add_argument("--save_every", type=positive, default=10)
    parser.add_argument("--log_every", type=positive, default=5)
    parser.add_argument("--recipe", default="delayed", choices=list(RECIPES))
    parser.add_argument("--model", default="tiny", help="GPTConfig preset (default: the quickstart's)")
    parser.add_argument("--n_layer", type=positive, default=None, help="override the preset's")
    parser.add_argument("--backend", default="auto", choices=["auto", "te", "torch"])
    parser.add_argument("--batch_size", type=positive, default=4)
    parser.add_argument("--seq_len", type=positive, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup_steps", type=int, default=5)
    parser.add_argument("--corpus_chars", type=positive, default=100_000,
                        help="characters of the embedded corpus to train on (the last 10%% "
                             "validates)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--no_cuda_graphs", action="store_true",
                        help="run the TE blocks eagerly (by default on a GPU they replay as CUDA "
                             "graphs: one graph on one GPU, a graph per block under DDP; never "
                             "under FSDP2)")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--devices", default="1", help="a count, or auto (every GPU)")
    parser.add_argument("--strategy", default="auto", choices=["auto", "ddp", "fsdp"],
                        help="several devices: ddp (DistributedDataParallel) or fsdp (FSDP2 in "
                             "units of blocks, BF16 gathers; the checkpoint becomes a directory "
                             "of shards)")
    args = parser.parse_args(argv)
    if args.strategy == "fsdp" and not args.devices.isdigit():
        parser.error(f"--strategy fsdp needs --devices N, a count (got {args.devices!r})")
    if os.path.exists(args.ckpt) and not args.fresh:
        # A sharded checkpoint (a directory) resumes only under FSDP2, a file only without it.
        sharded = os.path.isdir(args.ckpt)
        if sharded != (args.strategy == "fsdp"):
            what = "a directory of FSDP2 shards" if sharded else "one file"
            parser.error(f"--ckpt {args.ckpt} is {what}, written {'with' if sharded else 'without'}"
                         " --strategy fsdp; resume it that way, or start over with --fresh or "
                         "another --ckpt")
    return args


def fsdp2(plugin: FabricFP8Precision, devices: int) -> ModelParallelStrategy:
    """FSDP2 through Fabric's ModelParallelStrategy: the model sharded in units of blocks as the
    Trainer's ``FSDP2Strategy`` shards it (BF16 gathers of the fp32 master shards where the run
    is bf16-mixed, fp32 gradient reduction; weights freed after each unit's forward, as this
    example estimates no memory), every device one data-parallel rank."""

    def parallelize(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
        reshard, per_unit, how = fsdp2_layout(model, None, None, fits_one_gpu=None)
        rank_zero_only(print)(f"FSDP2: {how}")
        shard_model(model, mesh["data_parallel"], mp_policy=gather_policy(plugin.weights),
                    reshard_after_forward=reshard, blocks_per_unit=per_unit)
        return model

    # Fabric's defaults would make the devices of a node one tensor-parallel group
    return ModelParallelStrategy(parallelize, data_parallel_size=devices, tensor_parallel_size=1)


def corpus_blocks(seq_len: int, chars: int) -> torch.Tensor:
    """The first ``chars`` characters of the embedded corpus as (N, seq_len + 1) token blocks."""
    ids = torch.tensor(get_tokenizer("gpt2").encode(EMBEDDED_CORPUS.read_text()[:chars]))
    n = ids.numel() // (seq_len + 1)
    if n < 2:
        raise SystemExit(f"--corpus_chars {chars} gives {n} block(s) of {seq_len + 1} tokens; "
                         "raise it or lower --seq_len")
    return ids[: n * (seq_len + 1)].view(n, seq_len + 1)


def save(fabric: L.Fabric, path: str, state: dict) -> None:
    """``fabric.save`` to a temporary name, then renamed: a run killed while saving leaves the
    previous checkpoint intact (the Trainer's ``Checkpoint`` callback does this for ``fit``).
    Under FSDP2 the checkpoint is a directory of shards, swapped in the same way."""
    tmp = path + ".tmp"
    if fabric.is_global_zero and os.path.isdir(tmp):
        shutil.rmtree(tmp)
    fabric.barrier()
    fabric.save(tmp, state)  # every rank writes its shard, or rank zero the whole file
    if fabric.is_global_zero:
        if os.path.isdir(tmp):
            publish_directory(Path(tmp), Path(path))
        else:
            os.replace(tmp, path)
    fabric.barrier()


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    plugin = FabricFP8Precision(recipe=args.recipe)
    devices = int(args.devices) if args.devices.isdigit() else args.devices
    # (parse_args made --devices a count for fsdp)
    strategy = fsdp2(plugin, devices) if args.strategy == "fsdp" else args.strategy
    fabric = L.Fabric(accelerator=args.accelerator, devices=devices, strategy=strategy,
                      plugins=[plugin])
    fabric.launch()  # before set-up: the plugin reduces amax over the process group it finds
    fabric.seed_everything(1337)

    # The quickstart's model and training recipe; GPTLightningModule builds them (TE layers where
    # TE can run, else PyTorch, with the reason). The GPT itself goes to Fabric: Fabric puts the
    # precision context around forward() only, and GPT.forward(x, targets) returns the loss.
    recipe = GPTLightningModule(GPTConfig(name=args.model, n_layer=args.n_layer),
                                backend=args.backend, learning_rate=args.lr, min_lr=args.lr / 10,
                                warmup_steps=args.warmup_steps, lr_decay_steps=args.steps,
                                compile=args.compile, cuda_graphs=False)
    recipe.configure_model()
    # The model first, then its optimizer: under FSDP2 the optimizer must hold the sharded
    # parameters that setup_module made.
    model = fabric.setup_module(recipe.model)
    optimization = recipe.configure_optimizers()
    scheduler = optimization["lr_scheduler"]["scheduler"]
    optimizer = fabric.setup_optimizers(optimization["optimizer"])
    guard = FabricNaNGuard(fabric, model, optimizer, check_every=args.log_every)

    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "fp8": plugin,
             "guard": guard, "step": 0}
    if os.path.exists(args.ckpt) and not args.fresh:
        load(fabric, args.ckpt, state)  # safely, the plugin's and the guard's state included
        fabric.print(f"resumed from {args.ckpt} at step {state['step']} (FP8 plugin history: "
                     f"{len(plugin.history)} events; NaN guard at step {guard.global_step})")
    fabric.print(f"precision: {plugin.status}")

    blocks = corpus_blocks(min(args.seq_len, recipe.config.block_size), args.corpus_chars)
    n_val = max(1, len(blocks) // 10)
    train, val = blocks[:-n_val], blocks[-n_val:]
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(1337))
    rank, world = fabric.global_rank, fabric.world_size

    def batch_at(step: int) -> torch.Tensor:
        """This rank's batch of ``step``: a function of the step alone, so a resume is exact."""
        first = (step * world + rank) * args.batch_size
        rows = order[torch.arange(first, first + args.batch_size) % len(train)]
        return fabric.to_device(train[rows].long())

    # The TE blocks replayed as CUDA graphs, as fit's step does (fp8_lightning/graphs.py): their
    # kernels launched from Python cost the host more than the GPU at these sizes.
    # (under FSDP2 a block's graph cannot hold the gather and reduce hooks: fit captures the
    # whole step there, fp8_lightning/step_graph.py; this loop replays blocks)
    graphs_on, why = graphs_status(fabric.device.type, world, sharded=args.strategy == "fsdp",
                                   whole_step=False)
    if graphs_on and (recipe.backend_name != "te" or args.no_cuda_graphs):
        graphs_on, why = False, ("--no_cuda_graphs" if args.no_cuda_graphs else
                                 "the PyTorch backend's blocks are not captured here")
    fabric.print("CUDA graphs: " + (("a graph per block" if world > 1 else "the blocks as one")
                                    if graphs_on else f"off ({why})"))
    graphs = None

    start, losses = state["step"], []
    window = (start, time.perf_counter())  # (step, time) of the last log line
    model.train()
    for step in range(start, args.steps):
        batch = batch_at(step)
        x, y = batch[:, :-1], batch[:, 1:]
        if graphs_on:  # captured at the first step, under the plugin's FP8 context as a forward
            with fabric.autocast():
                graphs = prepare_graphs(graphs, recipe.model, tuple(x.shape), per_block=world > 1)
        loss = model(x, y)
        fabric.backward(loss)
        # error_if_nonfinite=False: a non-finite norm is the guard's to handle (on the device)
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        guard.before_optimizer_step(loss, norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        guard.after_optimizer_step()
        state["step"] = step + 1
        if state["step"] % args.log_every == 0 or state["step"] == args.steps:
            losses.append(loss.item())  # the one host sync every log_every steps
            now = time.perf_counter()
            ms = 1000 * (now - window[1]) / (state["step"] - window[0])
            window = (state["step"], now)
            fabric.print(f"step {state['step']:>5} | loss {losses[-1]:.4f} | "
                         f"lr {scheduler.get_last_lr()[0]:.2e} | {ms:.0f} ms/step | "
                         f"tok/s per GPU {batch.shape[0] * (batch.shape[1] - 1) / ms * 1e3:,.0f} | "
                         f"{plugin.effective_precision}")
        if state["step"] % args.save_every == 0 or state["step"] == args.steps:
            save(fabric, args.ckpt, state)
    guard.end()

    model.eval()  # evaluation forwards run BF16 (FabricFP8Precision(fp8_eval=True) for FP8)
    with torch.no_grad():
        batch = fabric.to_device(val[: args.batch_size].long())
        val_loss = fabric.all_reduce(model(batch[:, :-1], batch[:, 1:]), reduce_op="mean").item()
    fabric.print(f"val loss {val_loss:.4f} after {state['step']} steps; checkpoint: {args.ckpt}")
    return {"step": state["step"], "losses": losses, "val_loss": val_loss, "plugin": plugin,
            "guard": guard, "graphs": graphs}


if __name__ == "__main__":  # (also keeps spawned data-loader workers from re-running it)
    main()
    # Fabric leaves the process group up; without this, gloo's worker threads can abort the
    # process at interpreter exit after a good run ("terminate called without an active
    # exception", exit -6: pytorch/pytorch#190489).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
