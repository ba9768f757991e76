"""CUDA graphs of the transformer blocks: their forward and backward replayed as CUDA graphs
(the whole stack as one, by default), through TransformerEngine's ``make_graphed_callables``
on the TE path (which captures FP8, delayed scaling included, and keeps the amax/scale updates
working across replays), and PyTorch's for the PyTorch backend's compiled blocks under DDP.

Why: a TE block issues its kernels from Python (host work per module per step), so at GPT-2
sizes the host, not the GPU, sets the step time (docs/benchmarks.md, what the fast path is made
of). A replayed graph costs the host one launch per graph and direction.

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

import functools
import gc
import inspect
import logging
from typing import Any, Optional, Sequence

import torch
from torch import nn

from .te_availability import te_available, te_module

log = logging.getLogger(__name__)


def fp8_state() -> tuple[bool, Any, Any]:
    """TE's autocast state right now: (FP8 enabled, recipe, amax reduction group)."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    if not FP8GlobalStateManager.is_fp8_enabled():
        return False, None, None
    return True, FP8GlobalStateManager.get_fp8_recipe(), FP8GlobalStateManager.get_fp8_group()


def fp8_now() -> bool:
    """Is TE's FP8 autocast on here (False without TE)?"""
    return te_available() and fp8_state()[0]


def te_debug_on() -> bool:
    """Is TE's debug API (FP8Stats) on? Its hooks run in Python, which a replay skips."""
    if not te_available():
        return False
    try:
        from transformer_engine.debug.pytorch.debug_state import TEDebugState
    except ImportError:
        return False
    return bool(TEDebugState.debug_enabled)


@functools.lru_cache(maxsize=None)
def _te_clones_grads_on_request() -> bool:
    """TE's make_graphed_callables takes clone_param_grads_on_return from 2.19 on (2.18 is the
    floor; before 2.19 it always clones)."""
    return "clone_param_grads_on_return" in \
        inspect.signature(te_module().make_graphed_callables).parameters


@functools.lru_cache(maxsize=None)
def _te_caching_kwarg() -> Optional[str]:
    """make_graphed_callables' switch for FP8 weight caching (``cache_quantized_params`` in TE
    2.20, ``fp8_weight_caching`` before), or None."""
    params = inspect.signature(te_module().make_graphed_callables).parameters
    return next((n for n in ("cache_quantized_params", "fp8_weight_caching") if n in params), None)


def _te_quantization_state() -> Any:
    """Where TE keeps the flag that tells captured modules to skip their weight casts."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    return getattr(FP8GlobalStateManager, "quantization_state", FP8GlobalStateManager)


def can_cache_weights(recipe: Any) -> bool:
    """Can captured blocks keep their FP8 weights across micro-batches (TE's FP8 weight caching)?
    Delayed scaling only: its weight cast honours TE's skip flag entirely; what the current and
    block recipes' own amax passes do with it is not checked here."""
    from transformer_engine.common.recipe import DelayedScaling

    return isinstance(recipe, DelayedScaling) and _te_caching_kwarg() is not None


@functools.lru_cache(maxsize=None)
def te_primes_after_warmup() -> bool:
    """TE's make_graphed_callables takes post_warmup_hook (2.20 does)."""
    return "post_warmup_hook" in inspect.signature(te_module().make_graphed_callables).parameters


def prime_compiled(units: Sequence[nn.Module], samples: Sequence[tuple],
                   sample_kwargs: Optional[Sequence[dict]]) -> None:
    """Between TE's warm-up and its capture: each ``torch.compile``'d unit once more forward in
    order, then backward in reverse, as the capture calls them. TE's warm-up puts a forward hook
    on every module of a unit, which Dynamo guards on, so without this the capture would
    recompile every block (and no compile may run while a graph is captured); after it, Dynamo
    may not compile again until the capture ends (``fail_on_recompile``: a guard that still
    differs fails at once, named)."""
    kwargs = sample_kwargs or [{}] * len(units)
    outs = [unit(*args, **kw) for unit, args, kw in zip(units, samples, kwargs)]
    for unit, out, args in reversed(list(zip(units, outs, samples))):
        leaves = torch.utils._pytree.tree_leaves
        wants = [t for t in leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        inputs = [a for a in leaves(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        inputs += [p for p in unit.parameters() if p.requires_grad]
        if wants:  # gradients returned, not accumulated: .grad stays as the warm-up left it
            torch.autograd.grad(wants, inputs, [torch.empty_like(t) for t in wants],
                                allow_unused=True)
    torch.compiler.set_stance("fail_on_recompile")


def capture(units: tuple[nn.Module, ...], samples: tuple[tuple, ...], te: bool,
            clone_grads: bool = True, sample_kwargs: Optional[tuple[dict, ...]] = None,
            compiled: bool = False, cache_weights: bool = False) -> list:
    """Capture ``units`` (called in this order in the forward, the reverse in the backward) with
    one sample call each: TE's ``make_graphed_callables`` (FP8 per the autocast state now) or,
    without TE, PyTorch's. Returns each unit's graphed ``forward``; the units keep their own.
    ``compiled``: the units' forwards are ``torch.compile``'d (TE only; :func:`prime_compiled`).
    ``cache_weights`` (TE, :func:`can_cache_weights`): the graphs cast each FP8 weight only when
    a replay passes ``is_first_microbatch=True`` and reuse the cast otherwise, as TE's flag
    (``_te_quantization_state().skip_fp8_weight_update_tensor``) says at replay time."""
    if compiled and not (te and te_primes_after_warmup()):
        raise RuntimeError("a compiled capture needs TE's make_graphed_callables with "
                           "post_warmup_hook (TransformerEngine 2.20)")
    fp8, recipe, group = fp8_state() if te else (False, None, None)
    unit_call = type(units[0]).__call__
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # No collective in flight when the capture starts (the NCCL watchdog's queries of
        # such work are what broke captures: pytorch/pytorch#104487).
        torch.cuda.synchronize()
    # The warm-up passes on random inputs write the amax history and the gradients; TE puts
    # the history back only after a capture that succeeded, so a failed one is undone here.
    saved_fp8 = None
    if te and fp8:
        from transformer_engine.pytorch.graph import save_fp8_tensors

        saved_fp8 = save_fp8_tensors(units, recipe)
    saved_grads = [(p, p.grad) for unit in units for p in unit.parameters()]
    # The warm-up's backwards also add into a fused weight gradient's FP32 buffer (fp8/wgrad.py),
    # which holds the gradient summed so far: kept on the host meanwhile (a copy on the GPU
    # would cost the capture another 4 bytes per weight), put back after.
    saved_main = [(p, p.main_grad.to("cpu")) for p, grad in saved_grads
                  if grad is not None and getattr(p, "main_grad", None) is grad]
    # A capture that raises leaves state behind: TE turns the garbage collector off for the
    # capture and on again only after one that succeeded, and torch.cuda.graph does not put the
    # capture's side stream back when capture_end raises.
    gc_was_on, stream = gc.isenabled(), torch.cuda.current_stream()
    te_kwargs = (dict(clone_param_grads_on_return=clone_grads)
                 if te and _te_clones_grads_on_request() else {})
    if compiled:
        te_kwargs["post_warmup_hook"] = functools.partial(prime_compiled, units, samples,
                                                          sample_kwargs)
    if cache_weights:
        te_kwargs[_te_caching_kwarg()] = True
    elif te:  # an earlier capture's flag would make this one's TE modules capture cached weight
        # casts (their forward reads the flag while capturing); its graphs hold their own
        _te_quantization_state().skip_fp8_weight_update_tensor = None
    try:
        # Capture refuses autocast's weight-cast cache (TE's check); the cache only saves
        # re-casting a weight used twice in one forward, which a replay never does.
        with torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"),
                            enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False):
            if te:
                te_module().make_graphed_callables(units, samples, num_warmup_iters=3,
                                                   sample_kwargs=sample_kwargs,
                                                   enabled=fp8, recipe=recipe,
                                                   amax_reduction_group=group, **te_kwargs)
            else:  # compiled blocks (compile_model(per_block=True)), BF16, no accumulation
                torch.cuda.make_graphed_callables(units, samples, num_warmup_iters=3)
    except BaseException:
        torch.cuda.set_stream(stream)
        if te:  # TE's capture flag stays set after a capture that raised, and eager TE
            # backwards would then skip their amax/scale updates
            from transformer_engine.pytorch.graph import set_capture_end

            set_capture_end()
            if saved_fp8 is not None:
                from transformer_engine.pytorch.graph import restore_fp8_tensors

                restore_fp8_tensors(units, saved_fp8)
        for param, grad in saved_grads:
            param.grad = grad
        for unit in units:
            unit.__dict__.pop("forward", None)
        raise
    finally:
        if compiled:
            torch.compiler.set_stance("default")
        for param, summed in saved_main:
            param.main_grad.copy_(summed)
        # A capture that raises leaves the class's __call__ wrapped in TE's autocast.
        type(units[0]).__call__ = unit_call
        if gc_was_on:
            gc.enable()
    # make_graphed_callables set each unit's ``forward`` to its graphed version (TE falls back
    # to the original one in eval mode)
    return [unit.__dict__["forward"] for unit in units]


def release(units: Sequence[nn.Module]) -> None:
    """Free captured units' graphs and memory pool: TE's graphed callables hold them in the
    ``reset`` and ``backward_dw`` closures it set on each unit."""
    for unit in units:
        reset = unit.__dict__.pop("reset", None)
        if reset is not None:
            reset()
        unit.__dict__.pop("backward_dw", None)


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
        self.graphed = capture(units, samples, te, clone_grads)
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
        release(self.units)
        self.graphed, self.fp8_flags = [], {}

    def matches(self, batch_shape: tuple[int, int]) -> bool:
        return self.key == self.key_of(batch_shape, self.te and fp8_state()[0])


def world_size() -> int:
    """The ranks training together (1 without a process group): where a model's own forward is
    converted, before any strategy hands the plan its data-parallel size."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def graphs_status(device_type: str, world_size: int, callbacks: list[Any] = (),
                  sharded: bool = False, whole_step: bool = True) -> tuple[bool, str]:
    """Can a training step replay CUDA graphs here, and why (not): the one place for the rules
    every model shares (a GPU, Python-side hooks, DDP, FSDP2). ``whole_step``: the model captures
    its whole step under FSDP2 (this package's GPT on the TE backend); another model's blocks are
    replayed one by one, which FSDP2 rules out. The PyTorch backend's compiled model has conditions
    of its own besides (:func:`fp8_lightning.fast_path.plan_graphs`)."""
    if device_type != "cuda":
        return False, "CUDA graphs need a GPU"
    if te_debug_on() or any(type(c).__name__ == "FP8Stats" for c in callbacks):
        return False, "FP8Stats reads TE's debug hooks, which run in Python, not in a replay"
    if sharded:  # FSDP2 gathers a block's weights into storage it frees and allocates again,
        # where a block's own replay would not see them: the whole step is one graph there
        if not whole_step:
            return False, ("FSDP2's hooks run in Python, outside a block's replay (only fit's "
                           "capture of the whole step, for this package's GPT on TE, holds them)")
        if any(type(c).__name__ == "FaultInjection" for c in callbacks):
            return False, ("FaultInjection's hooks on the embedding run in Python, not in a "
                           "replay of the whole step")
        return True, "FSDP2, the whole step as one graph (fp8_lightning/step_graph.py)"
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
    them, so the clone of every gradient per step (a full pass over them; docs/benchmarks.md,
    what the fast path is made of) is saved. With accumulation the next micro-batch's replay
    would overwrite the gradient
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
