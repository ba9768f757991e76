"""The memory check before a fit on a GPU: the run's shape read from the Trainer, the FP8 plugin
and the data module, the estimate (:mod:`fp8_lightning.memory`) logged per GPU against what the
GPU has, and a run that cannot fit stopped with the levers that would make it fit."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from .config import ConfigError, GPTConfig
from .distributed import is_sharded, reshards
from .fp8.plugin import fp8_plugin
from .memory import GIB, RunShape, estimate_memory, fit_problem


def run_shape(trainer: "L.Trainer", datamodule: Any, config: GPTConfig, backend: str, *,
              activation_checkpointing: str, activation_checkpointing_every: int,
              compiled_loss: bool) -> Optional[RunShape]:
    """What besides the model decides this fit's memory per GPU (the micro-batch from the data
    module, sharding, FP8, residual, checkpointing, master dtype, compile, accumulation); None
    when the micro-batch is not known before the first batch."""
    batch_size = getattr(datamodule, "batch_size", None)
    if not batch_size:
        return None
    plugin = fp8_plugin(trainer)
    precision = plugin.precision if plugin is not None else str(trainer.precision)
    return RunShape(batch_size=batch_size,
                    seq_len=getattr(datamodule, "seq_len", None) or config.block_size,
                    shards=shard_count(trainer),
                    fp8=plugin is not None and backend == "te",
                    fp32_residual=config.residual_in_fp32(backend),
                    activation_checkpointing=activation_checkpointing,
                    activation_checkpointing_every=activation_checkpointing_every,
                    master_bytes=2 if precision in ("bf16-true", "16-true") else 4,
                    compiled_loss=compiled_loss,
                    accumulate_grad_batches=trainer.accumulate_grad_batches)


def shard_count(trainer: "L.Trainer") -> int:
    """Ranks the training state is sharded over: 1 unsharded (DDP), the world under FSDP2, the
    ranks of a replica group under HSDP (``FSDP2Strategy.shards``)."""
    if not is_sharded(trainer.strategy):
        return 1
    return getattr(trainer.strategy, "shards", None) or trainer.world_size


def is_gpu_fit(trainer: Optional["L.Trainer"]) -> bool:
    """Is ``trainer`` fitting on a GPU: the one case the check estimates for."""
    device = trainer.strategy.root_device if trainer is not None else None
    return device is not None and device.type == "cuda" and trainer.training


@dataclass(frozen=True)
class MemoryCheck:
    """What the check found.

    Attributes:
        fits_one_gpu: under FSDP2, would the run fit one GPU unsharded (None: not estimated).
        step_graph_fits: under FSDP2, is there room for the step's CUDA graph.
        problem: why the run does not fit, with the levers that would make it fit; or None.
    """

    fits_one_gpu: Optional[bool] = None
    step_graph_fits: bool = True
    problem: Optional[str] = None

    def enforce(self, memory_check: bool) -> None:
        """Stop a run that does not fit (``model.memory_check``), or warn and let it run."""
        if self.problem and memory_check:
            raise ConfigError([f"{self.problem} (model.memory_check: false runs it anyway)"],
                              "run for this GPU")
        if self.problem:
            rank_zero_warn(f"memory: {self.problem}; running anyway (model.memory_check: false)")


def check_memory(trainer: "L.Trainer", config: GPTConfig, run: RunShape, *, backend: str,
                 step_graph: bool) -> MemoryCheck:
    """Estimate ``run`` against the GPU memory free on every rank and log it. ``step_graph``:
    FSDP2's step graph is not turned off (``model.cuda_graphs``)."""
    device = trainer.strategy.root_device
    free, _ = torch.cuda.mem_get_info(device)
    budget = torch.tensor(free + torch.cuda.memory_reserved(device), device=device,
                          dtype=torch.float64)  # what this process holds is ours
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # Every rank takes the same decision, on the GPU with the least room: a rank that
        # stopped alone would leave the others waiting in their first collective.
        torch.distributed.all_reduce(budget, op=torch.distributed.ReduceOp.MIN)
    budget = budget.item()
    fits_one_gpu, step_graph_fits = None, True
    if run.shards > 1:  # FSDP2: would it fit unsharded (FSDP2Strategy keeps weights gathered)?
        fits_one_gpu = estimate_memory(config, replace(run, shards=1)).total <= budget
        setting = getattr(trainer.strategy, "reshard_after_forward", True)
        run = replace(run, keep_gathered=not reshards(setting, fits_one_gpu))
    if run.shards > 1 and backend == "te" and step_graph:
        # FSDP2's step graph, where plan_graphs would capture it (it decides when training
        # starts, told this): the gradients kept, and the graph's pool beside the eager
        # step after a validation. Where it does not fit, the run trains without it.
        graph = estimate_memory(config, replace(run, gradients_kept=True))
        step_graph_fits = graph.total + graph.activations <= budget
    rank_zero_info(f"memory: estimated {estimate_memory(config, run).describe()} of "
                   f"{budget / GIB:.1f} GiB on {torch.cuda.get_device_name(device)} "
                   "(fp8_lightning/memory.py)")
    several_nodes = trainer.num_nodes > 1 or getattr(trainer.strategy, "replicas", 1) > 1
    return MemoryCheck(fits_one_gpu, step_graph_fits,
                       fit_problem(config, run, budget, trainer.world_size, several_nodes))
