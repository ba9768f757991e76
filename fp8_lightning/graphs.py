"""CUDA graphs of the transformer blocks: their forward and backward replayed as CUDA graphs
(the whole stack as one, by default), through TransformerEngine's ``make_graphed_callables``
on the TE path (which captures FP8, delayed scaling included, and keeps the amax/scale updates
working across replays), and PyTorch's for the PyTorch backend's compiled blocks under DDP.

Why: a TE block issues its kernels from Python (a few hundred microseconds of host work per
module per step), so at GPT-2 sizes the host, not the GPU, sets the step time. A replayed graph
costs the host one launch per graph and direction.

What stays outside the graphs: the embedding, the final norm, the LM head and the loss (the
compiled loss is one call), the optimizer, and under DDP the gradient all-reduce: each block is
its own graph there, so a block's gradients reach DDP's buckets as soon as its backward replay
ends and their all-reduce overlaps the next block's backward (PyTorch's partial-network capture
with DDP: the collectives stay outside the captured sections). The blocks' graphs are captured
lazily at the first training step (they need its micro-batch shape) and are used only while the
model trains with the FP8 state they were captured with; otherwise (validation, a BF16
fallback, another shape) the blocks run eagerly.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from .te_support import te_module

log = logging.getLogger(__name__)


def fp8_state() -> tuple[bool, Any, Any]:
    """TE's autocast state right now: (FP8 enabled, recipe, amax reduction group)."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    if not FP8GlobalStateManager.is_fp8_enabled():
        return False, None, None
    return True, FP8GlobalStateManager.get_fp8_recipe(), FP8GlobalStateManager.get_fp8_group()


class BlockGraphs:
    """The captured graphs of a model's blocks, and the switch between them and eager.

    ``per_block``: one graph per block (two replays per block and step: under DDP, so that each
    block's gradients are all-reduced while the blocks before it run their backward) or one graph
    of the whole stack (one replay per direction: the least host time on one GPU).
    """

    def __init__(self, model: nn.Module, batch_shape: tuple[int, int],
                 clone_grads: bool = True, per_block: bool = False) -> None:
        te = model.backend == "te"
        fp8, recipe, group = fp8_state() if te else (False, None, None)
        units = tuple(model.blocks) if per_block else (model.blocks,)
        B, T = batch_shape
        weight = model.wte.weight
        dtype = model.residual_dtype(weight)  # the residual stream as the blocks receive it
        # One sample per unit: the residual stream (B, T, C) as it enters, and the RoPE tables
        # (the same tensors every step, so a replay copies nothing for them).
        samples = tuple((torch.randn(B, T, weight.shape[1], dtype=dtype,
                                     device=weight.device, requires_grad=True), *model.rope(T))
                        for _ in units)
        self.key, self.te, self.recipe = self.key_of(batch_shape, fp8), te, recipe
        self.units, self.n_blocks = units, len(model.blocks)
        unit_call = type(units[0]).__call__
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # No collective in flight when the capture starts (the NCCL watchdog's queries of
            # such work are what broke captures: pytorch/pytorch#104487).
            torch.cuda.synchronize()
        try:
            # Capture refuses autocast's weight-cast cache (TE's check); the cache only saves
            # re-casting a weight used twice in one forward, which a replay never does.
            with torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"),
                                enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False):
                if te:
                    te_module().make_graphed_callables(units, samples, num_warmup_iters=3,
                                                       enabled=fp8, recipe=recipe,
                                                       amax_reduction_group=group,
                                                       clone_param_grads_on_return=clone_grads)
                else:  # compiled blocks (compile_model(per_block=True)), BF16, no accumulation
                    torch.cuda.make_graphed_callables(units, samples, num_warmup_iters=3)
        except BaseException:
            if te:  # TE's capture flag stays set after a capture that raised, and eager TE
                # backwards would then skip their amax/scale updates
                from transformer_engine.pytorch.graph import set_capture_end

                set_capture_end()
            raise
        finally:
            # A capture that raises leaves the class's __call__ wrapped in TE's autocast.
            type(units[0]).__call__ = unit_call
        # make_graphed_callables set each unit's ``forward`` to its graphed version (TE falls
        # back to the original one in eval mode); keep them, to switch per step.
        self.graphed = [unit.__dict__["forward"] for unit in units]
        self.active = True
        # TE sets ``module.fp8`` on each Python forward (FP8Precision reads it to verify that FP8
        # ran); a replay runs no Python, so the capture's flags are put back on every switch.
        self.fp8_flags = {m: m.fp8 for unit in units for m in unit.modules()
                          if te and hasattr(m, "fp8")}

    @staticmethod
    def key_of(batch_shape: tuple[int, int], fp8: bool) -> tuple:
        return tuple(batch_shape), fp8

    def use(self, on: bool) -> None:
        """Replay the graphs (``on``) or run the blocks' own forward."""
        if on == self.active:
            return
        for unit, graphed in zip(self.units, self.graphed):
            if on:
                unit.forward = graphed
            else:
                del unit.forward  # the class's forward again
        if on:
            for module, flag in self.fp8_flags.items():
                module.fp8 = flag
        self.active = on

    def release(self) -> None:
        """The blocks' own forward again, and the graphs and their memory pool freed (TE's
        graphed callables hold them in ``reset`` and ``backward_dw`` closures as well)."""
        self.use(False)
        for unit in self.units:
            reset = unit.__dict__.pop("reset", None)
            if reset is not None:
                reset()
            unit.__dict__.pop("backward_dw", None)
        self.graphed, self.fp8_flags = [], {}

    def matches(self, batch_shape: tuple[int, int]) -> bool:
        return self.key == self.key_of(batch_shape, self.te and fp8_state()[0])


def graphs_status(device_type: str, world_size: int, callbacks: list[Any] = (),
                  sharded: bool = False) -> tuple[bool, str]:
    """Can a training step replay CUDA graphs here, and why (not): the TE path's blocks, and
    the PyTorch backend's compiled model (which has conditions of its own besides)."""
    if device_type != "cuda":
        return False, "CUDA graphs need a GPU"
    if sharded:  # FSDP2 gathers each block's weights in Python hooks into storage it frees and
        # reallocates, which a replay would not see; and capturing a block ran its forward before
        # the root's, which FSDP2 then refused ("FSDP state has already been lazily initialized
        # for blocks.0")
        return False, "FSDP2's hooks run in Python, outside a replay"
    if any(type(c).__name__ == "FP8Stats" for c in callbacks):
        return False, "FP8Stats reads TE's debug hooks, which run in Python, not in a replay"
    # DDP: its all-reduce runs in autograd hooks after each captured block's backward
    return True, "one GPU" if world_size == 1 else "DDP, a graph per block"


FAILED = "failed"  # prepare_graphs' result after a failed capture: never tried again


def prepare_graphs(graphs: Any, model: nn.Module, batch_shape: tuple[int, int],
                   accumulate_grad_batches: int = 1, per_block: bool = False) -> Any:
    """Before a training forward: capture on first use, then replay only while the micro-batch
    shape and the FP8 state are the ones captured (else eager for this step).

    Without gradient accumulation the parameter gradients are the graphs' own static buffers
    (TE's ``clone_param_grads_on_return=False``): each step's optimizer consumes them before the
    next replay overwrites them, and ``zero_grad(set_to_none=True)`` (Lightning's default) drops
    them, so the clone of every gradient per step (a full pass over them: ~3 ms at 1.3B on an
    H100) is saved. With accumulation the next micro-batch's replay would overwrite the gradient
    being accumulated into, so they are cloned.
    """
    if graphs is FAILED:
        return graphs
    if graphs is None:
        try:
            graphs = BlockGraphs(model, batch_shape, clone_grads=accumulate_grad_batches > 1,
                                 per_block=per_block)
        except Exception as err:  # noqa: BLE001 - the step still runs, eagerly, and says why
            for unit in (model.blocks, *model.blocks):
                unit.__dict__.pop("forward", None)
            message = (str(err).strip().splitlines() or [""])[0][:300]
            log.warning("CUDA graphs: capture failed (%s: %s); training without them",
                        type(err).__name__, message)
            return FAILED
        log.info("CUDA graphs: %d blocks captured as %s for micro-batch %s (%s)",
                 graphs.n_blocks, "one graph" if len(graphs.units) == 1 else "a graph each",
                 "x".join(map(str, batch_shape)), "FP8" if graphs.key[-1] else "BF16")
    graphs.use(graphs.matches(batch_shape))
    return graphs
