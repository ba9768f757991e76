"""Several GPUs: FSDP2 through Lightning's ``ModelParallelStrategy``, and sharded checkpoints.

DDP needs no strategy of its own: ``--trainer.strategy ddp`` works as it is, because ``FP8Precision``
reduces the delayed-scaling amax over the data-parallel group and ``NaNGuard`` all-reduces its
skip flag every step (one rank's NaN makes every rank skip). What DDP and FSDP2 share here:
``AgreedStop``: all ranks stop together on SIGTERM, without Lightning's host sync per step.

Why FSDP2 (``fully_shard``) and not FSDP1 (Lightning's ``FSDPStrategy``):

* ``FSDPStrategy`` only takes an ``FSDPPrecision`` plugin, so the FP8 plugin would have to become
  a second, FSDP-specific class (the reason Lightning's own TransformerEngine plugin cannot be
  used with FSDP at all). ``ModelParallelStrategy`` takes any precision plugin: the one
  ``FP8Precision`` serves single GPU, DDP and FSDP.
* FSDP2 shards each parameter as a ``DTensor`` and keeps module and parameter names unchanged.
  TE modules see ordinary tensors in forward (FSDP1 flattens them into one ``FlatParameter``),
  and the checkpoint keys are the single-GPU keys.
* Sharded checkpoints are ``torch.distributed.checkpoint`` (DCP) directories that reshard on load,
  so a run saved on 4 GPUs resumes on 2. Lightning's ``ModelParallelStrategy`` writes and reads
  them; this module makes the write atomic.
* FSDP1 is in maintenance upstream; torchtitan and TE's own FSDP examples moved to FSDP2.

HSDP (``FSDP2Strategy(replicate=N)``, by default one replica per node): ``fully_shard`` on a 2-D
(replicate, shard) mesh shards the model within each group of world/N ranks and replicates it
across the groups, so the per-unit all-gathers and reduce-scatters stay on a node's links and only
the gradient all-reduce between replicas crosses nodes. Data parallelism still spans every rank
(each reads its own samples); delayed scaling's amaxes are reduced over the world and torchao's
float8 weight scales over a shard group of identical replicas, so every rank quantises alike; the
DCP shards reshard on load into any other layout (HSDP 2x2 -> FSDP2 on 4 -> one file).

FP8 scaling state under FSDP2: it never goes into the DCP shards. ``FP8Precision`` replaces each TE
module's pickled ``_extra_state`` by an empty tensor and stores the delayed-scaling amax history
and scales as plain tensors in its own state, which Lightning writes to the directory's
``meta.pt`` (rank 0; the amaxes are reduced over all ranks, so every rank holds the same values).
That side-steps TE's variable-size pickled extra state in DCP (NVIDIA/TransformerEngine#1860).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import warnings
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import lightning as L
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message
from torch import nn
from typing_extensions import override

from .checkpoint_files import (load_checkpoint_file, publish_directory, safe_lightning_dcp_loads,
                         temporary_beside)
from .fp8.plugin import fp8_plugin
from .device_mesh import describe_mesh, fsdp2_mesh, replica_problems, replicas
from .fp8.policy import find_gpt, repeated_blocks

log = logging.getLogger(__name__)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor``; any other tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A ``DTensor`` gathered (a collective, on the device); any other tensor as it is."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def is_sharded(strategy: Any) -> bool:
    """Does ``strategy`` shard parameters (so that every rank must run every forward)?"""
    from lightning.pytorch.strategies import FSDPStrategy

    return isinstance(strategy, (ModelParallelStrategy, FSDPStrategy))


def shard_model(model: nn.Module, mesh: Any, *, blocks: Optional[Sequence[nn.Module]] = None,
                mp_policy: Any = None, reshard_after_forward: bool = True,
                blocks_per_unit: int = 1) -> None:
    """FSDP2 per group of transformer blocks, then the root (embeddings, final norm, LM head).

    Args:
        model: the root: the :class:`~fp8_lightning.model.GPT`, or a model of your own.
        mesh: the 1-D data-parallel device mesh (FSDP2), or a 2-D (replicate, shard) one
            (HSDP: :func:`fsdp2_mesh`).
        blocks: the model's repeated blocks in forward order (default: :func:`repeated_blocks`).
        mp_policy: an FSDP2 ``MixedPrecisionPolicy`` (``None``: parameters in their own dtype).
        reshard_after_forward: free each unit's gathered weights after its forward (ZeRO-3). The
            last unit keeps them either way: backward needs them first (torchtitan does the same).
        blocks_per_unit: consecutive blocks gathered and reduced together (one ``fully_shard``
            over a list of blocks): fewer, larger collectives and fewer Python hooks per step,
            for more gathered memory at a time.
    """
    from torch.distributed.fsdp import fully_shard

    # GPT.forward returns a slice of the padded logits (a view); nothing modifies it in place, so
    # FSDP2's warning about in-place ops on returned views does not apply.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    kwargs = {"mesh": mesh} if mp_policy is None else {"mesh": mesh, "mp_policy": mp_policy}
    blocks = repeated_blocks(model) if blocks is None else list(blocks)
    n = max(1, blocks_per_unit)
    units = [blocks[i:i + n] for i in range(0, len(blocks), n)]
    dtype = getattr(mp_policy, "param_dtype", None)
    cast = dtype is not None and getattr(mp_policy, "cast_forward_inputs", False)
    for i, unit in enumerate(units):
        fully_shard(unit if len(unit) > 1 else unit[0],
                    reshard_after_forward=reshard_after_forward and i < len(units) - 1, **kwargs)
        for block in unit[1:] if cast else ():
            # PyTorch before pytorch/pytorch#180428 casts the forward inputs of a unit's first
            # block only: the later ones would get the RoPE tables in fp32, so a run's numerics
            # would depend on the grouping. Cast them as for a unit of one block.
            block.register_forward_pre_hook(functools.partial(_cast_floating_inputs, dtype),
                                            with_kwargs=True)
    # The root's parameters are needed again at the start of backward: keep them gathered.
    fully_shard(model, reshard_after_forward=False, **kwargs)


def _cast_floating_inputs(dtype: torch.dtype, module: nn.Module, args: tuple, kwargs: dict
                          ) -> Optional[tuple[tuple, dict]]:
    # Block.forward(x, *rope) takes tensors only: the common case (all cast) returns at once
    if not kwargs and all(not isinstance(a, torch.Tensor) or not a.is_floating_point()
                          or a.dtype == dtype for a in args):
        return None
    from torch.utils._pytree import tree_map_only

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if torch.is_floating_point(t) else t

    return tree_map_only(torch.Tensor, cast, args), tree_map_only(torch.Tensor, cast, kwargs)


def gather_policy(weights: str) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for a run whose weights are ``weights`` (the precision
    plugin's): BF16 gathers of the fp32 master shards and fp32 gradient reduction for
    ``bf16-mixed``; None (gathers in the parameters' own dtype) otherwise."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if weights != "bf16-mixed":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


# Parameters per FSDP2 unit that amortise a unit's Python hooks and collective launches: fewer
# hooks a step made GPT-2 124M (its 12 blocks in one unit) and the 1.3B (6 blocks a unit) faster
# than a block a unit (docs/benchmarks.md, how the FSDP2 layout was chosen); an 8B block
# (218M) is a unit alone.
UNIT_PARAMS = 200_000_000


class AgreedStop:
    """Several ranks stop together on a SIGTERM or the CLI's Ctrl-C, with no host sync per step.

    Lightning >= 2.6 broadcasts rank 0's SIGTERM flag at the start of every training step and
    reads it with ``.item()``: a host sync per step, after which the GPU idles while the host
    issues the next step (measured under DDP: docs/benchmarks.md, several GPUs;
    Lightning-AI/pytorch-lightning#21487). Here each rank's stop request is all-reduced (max) at
    every step start instead, and read one step late: from pinned memory behind a CUDA event,
    which the GPU passed long ago. Every rank then raises Lightning's ``SIGTERMException`` at the
    same step, the one after the request was seen. The request is kept out of Lightning's own flag
    until then (its loops would stop the signalled rank alone at the end of its step, leaving the
    others in a collective), so Lightning's SIGTERM notifier is replaced by :meth:`_on_sigterm`,
    which records the request and forwards the signal to the local ranks as Lightning's does,
    without Lightning's extra broadcast from the signal handler.
    """

    def __init__(self, trainer: "L.Trainer") -> None:
        device = trainer.strategy.root_device
        self.trainer, self.cuda = trainer, device.type == "cuda"
        self.requested = False  # this rank's request, not yet agreed
        # two slots, used in turn: a step's flag is read while the next one is in flight
        self.flags = [torch.zeros(1, dtype=torch.int32, device=device) for _ in range(2)]
        self.host = [torch.zeros(1, dtype=torch.int32, pin_memory=self.cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)] if self.cuda else []
        self.steps = 0

    def request(self) -> None:
        """Stop all ranks at a step boundary (this rank's SIGTERM, or the CLI's first Ctrl-C)."""
        self.requested = True

    def _on_sigterm(self, signum: Any, frame: Any) -> None:
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", self.trainer.global_rank))
        launcher = self.trainer.strategy.launcher
        if not self.requested and launcher is not None:
            launcher.kill(signum)  # the other local ranks, as Lightning's notifier does
        self.request()

    def __call__(self) -> None:
        """At each training step's start, in place of Lightning's broadcast and read."""
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        i, previous = self.steps % 2, (self.steps + 1) % 2
        self.steps += 1
        self.flags[i].fill_(1 if self.requested else 0)
        torch.distributed.all_reduce(self.flags[i], op=torch.distributed.ReduceOp.MAX)
        self.host[i].copy_(self.flags[i], non_blocking=self.cuda)
        if self.cuda:
            self.events[i].record()
        if self.steps == 1:
            return
        if self.cuda:
            self.events[previous].synchronize()  # the previous step's start: passed on the GPU
        if int(self.host[previous]) == 1:
            # Lightning's flag now: its exception path and the CLI read it as a SIGTERM stop
            self.trainer._signal_connector.received_sigterm = True
            raise SIGTERMException()

    @staticmethod
    def install(trainer: "L.Trainer") -> Optional["AgreedStop"]:
        """Take over the training loop's per-step SIGTERM broadcast and Lightning's SIGTERM
        notifier for this fit (several ranks); None where Lightning's own stay (one process, a
        Lightning without the broadcast, or its notifier not installed: not the main thread)."""
        import signal

        from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose

        loop = trainer.fit_loop.epoch_loop
        if (trainer.world_size < 2 or not torch.distributed.is_initialized()
                or not hasattr(loop, "_broadcast_sigterm_tensor")):
            return None
        handler = signal.getsignal(signal.SIGTERM)
        notifier = trainer._signal_connector._sigterm_notifier_fn
        if not isinstance(handler, _HandlersCompose) or notifier not in handler.signal_handlers:
            return None
        stop = AgreedStop(trainer)
        handler.signal_handlers[handler.signal_handlers.index(notifier)] = stop._on_sigterm
        loop._broadcast_sigterm_tensor = stop
        return stop

    @staticmethod
    def of(trainer: "L.Trainer") -> Optional["AgreedStop"]:
        """The one installed for this trainer's fit, if any."""
        stop = trainer.fit_loop.epoch_loop.__dict__.get("_broadcast_sigterm_tensor")
        return stop if isinstance(stop, AgreedStop) else None

    @staticmethod
    def uninstall(trainer: "L.Trainer") -> None:
        """Lightning's broadcast again (a later fit of another module on this trainer); its
        signal handlers are restored by Lightning at the end of each fit."""
        trainer.fit_loop.epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)


def reshards(reshard_after_forward: Optional[bool], fits_one_gpu: Optional[bool]) -> bool:
    """FSDP2Strategy's ``reshard_after_forward`` as it runs: as set, or (None) free the weights
    after forward unless the run fits one GPU unsharded (then they cost less than DDP's copy)."""
    return not fits_one_gpu if reshard_after_forward is None else reshard_after_forward


def fsdp2_layout(model: nn.Module, reshard_after_forward: Optional[bool],
                 blocks_per_unit: Optional[int], fits_one_gpu: Optional[bool],
                 blocks: Optional[Sequence[nn.Module]] = None) -> tuple[bool, int, str]:
    """The FSDP2 layout of a GPT or of a model of your own whose repeated blocks are ``blocks``
    (default: :func:`repeated_blocks`): (reshard after forward, blocks per unit, why), each
    setting as given or, where None, chosen: weights kept gathered from forward to backward when
    the run would fit one GPU unsharded (then they cost less than DDP's whole copy), blocks
    grouped into units of about ``UNIT_PARAMS`` parameters."""
    why = []
    if reshard_after_forward is None:
        reshard_after_forward = reshards(None, fits_one_gpu)
        why.append("weights kept gathered from forward to backward: the run fits one GPU"
                   if fits_one_gpu else "weights freed after each unit's forward: the run does not"
                   " fit one GPU unsharded" if fits_one_gpu is False else
                   "weights freed after each unit's forward: memory not estimated")
    blocks = repeated_blocks(model) if blocks is None else blocks
    n = len(blocks)
    if blocks_per_unit is None:
        block = sum(p.numel() for p in blocks[0].parameters()) if n else 1
        blocks_per_unit = max(1, min(n, round(UNIT_PARAMS / max(1, block))))
        why.append(f"~{UNIT_PARAMS / 1e6:.0f}M parameters a unit")
    units = -(-n // blocks_per_unit)
    return (reshard_after_forward, blocks_per_unit,
            f"{n} blocks in {units} unit(s) of up to {blocks_per_unit}, "
            f"reshard_after_forward={reshard_after_forward}" + (f" ({'; '.join(why)})"
                                                                 if why else ""))


def ddp_hint(fits_one_gpu: Optional[bool]) -> Optional[str]:
    """Where an FSDP2 run fits one GPU unsharded: that DDP is the other choice, and where the two
    are compared. (Which is faster depends on the model and on whether FSDP2's step graph runs:
    docs/benchmarks.md, "Several GPUs", has both side by side.)"""
    if not fits_one_gpu:
        return None
    return ("FSDP2: this run fits one GPU unsharded, where DDP (configs/ddp.yaml) gathers no "
            "weights at any step; docs/several-gpus.md says which of the two to try first")


def fsdp2_units(module: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
    """What FSDP2Strategy shards in a LightningModule: its ``model``, this package's GPT or a
    model of your own (a Hugging Face ``LlamaForCausalLM``...), as the root, and that model's
    repeated blocks as the units (:func:`repeated_blocks`). No units where ``configure_model``
    called ``fully_shard`` itself (the parameters are DTensors): that layout stays. A model it
    cannot shard: one error line, saying what to do."""
    from torch.distributed.tensor import DTensor

    from .config import ConfigError

    model, name = find_gpt(module), type(module).__name__
    if any(isinstance(p, DTensor) for p in module.parameters()):
        return model, []
    yourself = ("call torch.distributed.fsdp.fully_shard in configure_model (on each of its "
                "blocks, then on the model) and FSDP2Strategy leaves that layout as it is")
    if model is module:
        raise ConfigError([f"{name} has no `self.model` (an nn.Module) to shard: set it in "
                           f"configure_model, or {yourself}"], "FSDP2Strategy")
    blocks = repeated_blocks(model)
    if not blocks:
        raise ConfigError([f"{name}.model ({type(model).__name__}) has no repeated blocks (an "
                           f"nn.ModuleList of two or more) to shard as FSDP2 units: {yourself}"],
                          "FSDP2Strategy")
    return model, blocks


def build_device(module: Any, device: torch.device) -> Optional[torch.device]:
    """Where FSDP2Strategy builds a GPT module before sharding it: on its GPU when the whole
    model's fp32 parameters take at most half of the memory free there (it stays whole until
    ``fully_shard``, as TE's layers always were), else None: the CPU."""
    from .memory import num_params

    config = getattr(module, "config", None)
    if device.type != "cuda" or config is None or not hasattr(config, "n_layer"):
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return device if 4 * num_params(config) <= free // 2 else None


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 data parallelism over every device: each block's parameters, gradients and optimizer
    state sharded across ranks (HSDP: across the ranks of each replica group), the model gathered
    block by block in forward and backward. The model is the LightningModule's ``self.model``:
    this package's GPT or a model of your own, its repeated blocks the units
    (:func:`fsdp2_units`; a TE recipe swaps the ``nn.Linear`` layers of a model of your own
    before the sharding). A ``configure_model`` that calls ``fully_shard`` itself keeps its own layout.

    Args:
        reshard_after_forward: free each unit's gathered weights after its forward (less memory,
            one more all-gather in backward) or keep them until backward (faster, more memory).
            ``None`` (default): keep them when the run would fit one GPU unsharded (the memory
            estimate), where they cost less than DDP's whole copy.
        param_dtype: dtype of the gathered weights. ``bfloat16`` (default): the fp32 master
            shards are gathered as BF16 copies (half the traffic of fp32) and gradients are
            reduced in fp32; the embedding output, and so the residual stream, is BF16.
            ``float32``: fp32 gathers with BF16 autocast, the numerics of one GPU or DDP; with TE
            FP8 layers TransformerEngine 2.20 fails in backward under FSDP2 ("GEMM requested the
            columnwise representation, but it is unavailable"), so that combination is refused.
        blocks_per_unit: consecutive blocks sharded as one FSDP2 unit (see :func:`shard_model`);
            ``None`` (default): units of about ``UNIT_PARAMS`` parameters.
        float8_all_gather: gather the weights of the float8 GEMMs as float8 (half the bytes of
            BF16 gathers), their scales from one all-reduce per step: the torchao engine with
            recipe ``tensorwise`` (torchao has it for no other recipe; the TE engine's FP8 weights
            are not built here). ``None`` (default): on where it can run, as torchtitan runs
            float8 under FSDP2; ``true`` elsewhere logs why not and weights gather in BF16. While
            the NaN guard runs BF16, the gathered weights keep float8's rounding.
        save_distributed_checkpoint: checkpoints as directories of shards (written in parallel,
            reshardable; ``python -m fp8_lightning consolidate`` makes one file of them) or as one
            file gathered on rank 0.
        process_group_backend: ``nccl`` on GPUs (default), ``gloo`` on CPUs.
        timeout: collective timeout.
        replicate: model replicas (HSDP): the model is sharded within each group of
            world size / ``replicate`` consecutive ranks and replicated across the groups, so
            all-gathers and reduce-scatters stay inside a group and only the gradient all-reduce
            crosses groups. ``None`` (default): ``trainer.num_nodes`` (a replica per node; on one
            node plain FSDP2); ``1``: plain FSDP2 over every rank (the least memory per GPU).
            Must divide the world size.
    """

    def __init__(self, reshard_after_forward: Optional[bool] = None,
                 param_dtype: str = "bfloat16", blocks_per_unit: Optional[int] = None,
                 float8_all_gather: Optional[bool] = None,
                 save_distributed_checkpoint: bool = True,
                 process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout,
                 replicate: Optional[int] = None) -> None:
        from .config import ConfigError

        problems = replica_problems(replicate)
        if param_dtype not in ("bfloat16", "float32"):
            problems.append(f"param_dtype={param_dtype!r}; valid: bfloat16, float32")
        if blocks_per_unit is not None and (isinstance(blocks_per_unit, bool)
                                            or not isinstance(blocks_per_unit, int)
                                            or blocks_per_unit < 1):
            problems.append(f"blocks_per_unit={blocks_per_unit!r}; valid: an integer >= 1")
        if problems:
            raise ConfigError(problems, "FSDP2Strategy")
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = param_dtype
        self.blocks_per_unit = blocks_per_unit
        self.float8_all_gather = float8_all_gather
        self.replicate = replicate
        self._fsdp2_mesh: Any = None  # what fully_shard takes (setup_environment)
        self._float8_weights: list[torch.Tensor] = []  # sharded, gathered as float8
        self._float8_scales_current = False  # precomputed since the weights last changed

    @override
    def setup_environment(self) -> None:
        # Every device is one data-parallel rank (ModelParallelStrategy's "auto" would make the
        # devices of a node a tensor-parallel group).
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()
        self._fsdp2_mesh = fsdp2_mesh(self.device_mesh, self.replicas)

    @override
    def _configure_launcher(self) -> None:
        # The Trainer's set-up has given the devices and nodes here, in every process (the
        # launching one, before it starts any; each torchrun or srun rank): a replica count that
        # does not fit them is one error there.
        from .config import ConfigError

        problems = replica_problems(self.replicate, self.num_nodes * self.num_processes)
        if problems:
            raise ConfigError(problems, "FSDP2Strategy")
        super()._configure_launcher()

    @property
    def replicas(self) -> int:
        """Model replicas (``replicate``, or one per node)."""
        return replicas(self.replicate, self.num_nodes)

    @property
    def shards(self) -> int:
        """Ranks a model is sharded over (the memory estimate's divisor): world / replicas."""
        return max(1, self.num_nodes * self.num_processes // self.replicas)

    @property
    def fsdp2_mesh(self) -> Any:
        """The mesh the model is sharded on: the data-parallel one, or (HSDP) 2-D (replicate,
        shard). Samplers use Lightning's ``device_mesh``: every rank its own data either way."""
        if self._fsdp2_mesh is None:
            raise RuntimeError("FSDP2Strategy.fsdp2_mesh before setup_environment")
        return self._fsdp2_mesh

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Iterator[None]:
        # ModelParallelStrategy builds on the CPU unless asked for the meta device; Lightning's
        # other strategies build on the root device. On the CPU, with torchrun's one OpenMP
        # thread a rank, a large model is slow to build and initialise.
        device = None if empty_init else build_device(self.lightning_module, self.root_device)
        with device or nullcontext(), super().tensor_init_context(empty_init):
            yield

    @override
    def setup(self, trainer: L.Trainer) -> None:
        from .model import GPT

        module = self.lightning_module
        gpt, blocks = fsdp2_units(module)
        if not blocks:  # its parameters are DTensors: sharded by configure_model or a first fit
            rank_zero_info(f"FSDP2: {type(module).__name__}'s model is sharded already (by its "
                           "configure_model, or an earlier fit); left as it is")
            super().setup(trainer)
            return
        mp_policy = None
        plugin = fp8_plugin(trainer)
        weights = plugin.weights if plugin is not None else trainer.precision
        if self.param_dtype == "bfloat16":
            mp_policy = gather_policy(weights)
        gathered = []
        if plugin is not None and plugin.engine.swaps_modules and not isinstance(gpt, GPT):
            # FSDP2 gathers each parameter into the module that held it when sharded: a model of
            # your own gets the engine's modules (TE's te.Linear for nn.Linear) before that
            plugin.convert_before_sharding(module)
            blocks = repeated_blocks(gpt)
        if plugin is not None and (self.float8_all_gather or (self.float8_all_gather is None
                                                              and plugin.gathers_float8)):
            gathered = plugin.float8_all_gather(gpt)  # before fully_shard, which must see them
        elif self.float8_all_gather:
            log.warning("FSDP2Strategy.float8_all_gather: no FP8 plugin; weights gather in BF16")
        reshard, per_unit, how = fsdp2_layout(gpt, self.reshard_after_forward,
                                              self.blocks_per_unit,
                                              getattr(module, "fits_one_gpu", None), blocks)
        rank_zero_info(f"FSDP2: {describe_mesh(self.fsdp2_mesh)}")
        rank_zero_info(f"FSDP2: {how}")
        advice = ddp_hint(getattr(module, "fits_one_gpu", None))
        if advice:
            rank_zero_info(advice)
        shard_model(gpt, self.fsdp2_mesh, blocks=blocks, mp_policy=mp_policy,
                    reshard_after_forward=reshard, blocks_per_unit=per_unit)
        # fully_shard replaced each parameter by its DTensor shard: the weights as they are now
        self._float8_weights = [getattr(module, name) for module, name in gathered]
        super().setup(trainer)  # converts the module: the FP8 plugin knows now if FP8 runs
        if mp_policy is None and plugin is not None and plugin.fp8_available:
            from .config import ConfigError

            raise ConfigError([f"FSDP2Strategy.param_dtype={self.param_dtype!r} with FP8 "
                               "TransformerEngine layers: TE fails in backward with fp32 gathers "
                               "under FSDP2 (seen with TE 2.20); use param_dtype: bfloat16"],
                              "trainer.strategy")

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._float8_weights and not self._float8_scales_current:
            # The scales of the weights as they are now (also after a resume or a NaN-guard
            # rollback: both come before a step), in one all-reduce, for this optimizer step's
            # all-gathers; the micro-batches of an accumulated step reuse them.
            from .fp8.torchao_engine import precompute_float8_scales

            precompute_float8_scales(self._float8_weights)
            self._float8_scales_current = True
        return super().training_step(*args, **kwargs)

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().optimizer_step(*args, **kwargs)
        if self._float8_weights:  # the weights changed: no stale scale for a validation gather
            from .fp8.torchao_engine import forget_float8_scales

            forget_float8_scales(self._float8_weights)
            self._float8_scales_current = False
        return out

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None
                        ) -> dict[str, Any]:
        # No code runs from a checkpoint: its meta.pt and .metadata are checked by the allow-listing
        # loaders first (one clear error), then Lightning reads the shards through the safe DCP
        # reader and planner, and the files with weights_only=True.
        path = Path(self.broadcast(str(checkpoint_path)))
        load_checkpoint_file(path, mmap=True)
        with safe_lightning_dcp_loads():
            return super().load_checkpoint(path, weights_only=True)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Optional[Any] = None) -> None:
        if not self._save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        # Atomic: every rank writes its shard into a fresh temporary directory beside the target,
        # then rank 0 swaps it in (renameat2 RENAME_EXCHANGE where the filesystem has it): a kill
        # at any moment leaves the previous checkpoint or the new one, never a mix.
        path = Path(self.broadcast(str(filepath)))
        tmp = temporary_beside(path, pid=self.broadcast(os.getpid()))  # rank 0's: one directory
        if self.is_global_zero and tmp.exists():
            shutil.rmtree(tmp)
        self.barrier("fp8l_ckpt_tmp")
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier("fp8l_ckpt_written")
        if self.is_global_zero:
            publish_directory(tmp, path)
        self.barrier("fp8l_ckpt_published")
