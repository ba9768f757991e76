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

import functools
import gc
import inspect
import logging
import types
import weakref
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from .te_support import te_available, te_module

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


def graphs_status(device_type: str, world_size: int, callbacks: list[Any] = (),
                  sharded: bool = False) -> tuple[bool, str]:
    """Can a training step replay CUDA graphs here, and why (not): the TE path's blocks, and
    the PyTorch backend's compiled model (which has conditions of its own besides)."""
    if device_type != "cuda":
        return False, "CUDA graphs need a GPU"
    if any(type(c).__name__ == "FP8Stats" for c in callbacks):
        return False, "FP8Stats reads TE's debug hooks, which run in Python, not in a replay"
    if sharded:  # FSDP2 gathers a block's weights into storage it frees and allocates again,
        # where a block's own replay would not see them: the whole step is one graph there
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


# ------------------------------------------------------------------------ any model's blocks
class _Tensor:
    """A recorded tensor argument: shape, dtype and ``requires_grad``; an integer tensor's value
    too (positions and masks may index, so the capture uses the real ones; a float one is drawn
    at random there, and every replay copies the call's own values in)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.key = (tuple(t.shape), t.dtype, t.requires_grad)
        self.value = None if t.is_floating_point() else t.detach().clone()

    def sample(self, device: torch.device) -> torch.Tensor:
        if self.value is not None:
            return self.value
        shape, dtype, requires_grad = self.key
        return torch.randn(shape, dtype=dtype, device=device, requires_grad=requires_grad)


class _Call:
    """One block's training call as recorded: its tensors (positional, and keyword tensors or
    tuples of tensors) and its other keyword arguments (None, bools, numbers, strings), which the
    capture fixes. ``unsupported``: why such a call cannot be captured (a positional argument or
    a keyword of another kind, e.g. Hugging Face's key/value cache object)."""

    CONSTANT = (type(None), bool, int, float, str)

    def __init__(self, args: tuple, kwargs: dict[str, Any], training: bool = True) -> None:
        self.fp8 = fp8_now()  # the FP8 state the call ran in (a BF16-policy block's: off)
        self.training = training  # the block's mode (dropout and the like are captured in it)
        self.unsupported = ""
        self.args = tuple(self._record(a, f"positional argument {i}") for i, a in enumerate(args))
        self.tensor_kwargs: dict[str, Any] = {}
        self.fixed: dict[str, Any] = {}
        for key, value in kwargs.items():
            if isinstance(value, self.CONSTANT):
                self.fixed[key] = value
            else:
                self.tensor_kwargs[key] = self._record(value, f"keyword {key!r}")

    def _record(self, value: Any, what: str) -> Any:
        if isinstance(value, torch.Tensor):
            return _Tensor(value)
        if isinstance(value, (tuple, list)) and value and \
                all(isinstance(v, torch.Tensor) for v in value):
            return tuple(_Tensor(v) for v in value)
        if not self.unsupported:
            kind = type(value).__name__
            hint = (" (Hugging Face: use_cache=False when training)" if kind.endswith("Cache")
                    else "")
            self.unsupported = f"its {what} is a {kind}{hint}"
        return None

    def matches(self, args: tuple, kwargs: dict[str, Any]) -> bool:
        """Is this call the recorded one (same tensor layout, same fixed arguments)?"""
        if len(args) != len(self.args) or \
                kwargs.keys() != self.tensor_kwargs.keys() | self.fixed.keys():
            return False
        return all(_same(r, a) for r, a in zip(self.args, args)) and \
            all(_same(r, kwargs[k]) for k, r in self.tensor_kwargs.items()) and \
            all(type(kwargs[k]) is type(v) and kwargs[k] == v for k, v in self.fixed.items())

    def sample(self, device: torch.device) -> tuple[tuple, dict[str, Any]]:
        """Tensors for the capture, laid out as the call's."""
        def make(r: Any) -> Any:
            return tuple(x.sample(device) for x in r) if isinstance(r, tuple) else r.sample(device)

        kwargs = {k: make(r) for k, r in self.tensor_kwargs.items()}
        return tuple(make(r) for r in self.args), kwargs


def _same(recorded: Any, value: Any) -> bool:
    if isinstance(recorded, _Tensor):
        return isinstance(value, torch.Tensor) and \
            recorded.key == (tuple(value.shape), value.dtype, value.requires_grad)
    return isinstance(value, (tuple, list)) and len(value) == len(recorded) and \
        all(_same(r, v) for r, v in zip(recorded, value))


def _te_layer(module: nn.Module) -> bool:
    """A TE module (te.Linear and the like) or a TE operation (te.LayerNorm, te.RMSNorm and
    te.ops' modules are operations in TE 2.20)."""
    if not te_available():
        return False
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
    from transformer_engine.pytorch.ops import Sequential
    from transformer_engine.pytorch.ops.op import BasicOperation

    return isinstance(module, (TransformerEngineBaseModule, BasicOperation, Sequential))


@contextmanager
def dynamo_around(blocks: Sequence[nn.Module],
                  opaque: Callable[[nn.Module], bool] = _te_layer) -> Iterator[None]:
    """While ``torch.compile``'d block forwards run (their capture): each ``opaque`` layer (TE's)
    is a call Dynamo runs eagerly, not one it traces into (TE 2.20's own compiled path needs a
    newer PyTorch than 2.11, and tracing into its modules fails there), and Dynamo may compile
    every block (same code, other modules: a recompile each) past its default recompile limit."""
    layers = [m for block in blocks for m in block.modules() if opaque(m)]
    for layer in layers:
        layer.forward = torch.compiler.disable(type(layer).forward.__get__(layer))
    config = torch._dynamo.config
    # per code object: a compile per block, warm-up and capture (prime_compiled); in all:
    # every block's frames, split at each TE layer, twice
    wanted = {"recompile_limit": 2 * len(blocks) + 8,
              "accumulated_recompile_limit": 64 * len(blocks)}
    limits = {name: max(getattr(config, name), value) for name, value in wanted.items()
              if hasattr(config, name)}
    try:
        with config.patch(**limits):
            yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)


class _BoundBlock(nn.Module):
    """A block with its recorded call's fixed keyword arguments bound: what is captured. Its
    parameters are the block's (the capture's input surface); it belongs to no model."""

    def __init__(self, block: nn.Module, forward: Callable, fixed: dict[str, Any]) -> None:
        super().__init__()
        self.block = block
        self._block_forward, self._fixed = forward, fixed

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._block_forward(*args, **kwargs, **self._fixed)


class ModelBlockGraphs:
    """CUDA graphs of another model's blocks (a user's module under ``FP8Precision`` on the TE
    engine, whose swapped ``te.Linear`` calls cost more host time than GPU time): each block's
    first call in a training forward (:meth:`training_forward`) is recorded, the blocks are
    captured at the next training step (a graph per block, in the order the model called them)
    and a block then replays its graph whenever its call matches the recorded one in the FP8
    state and the ``train()``/``eval()`` mode it was captured in; any other call (evaluation,
    a BF16 fallback, another shape, under ``torch.compile``, a second call before the first's
    backward) runs the block's own forward. Parameters moved or (un)frozen since the capture:
    recorded and captured again, as after a few training forwards in another FP8 state (a BF16
    fallback, FP8 back). A block whose recorded call ran in another FP8 state than the capture's
    (a block the layer policy keeps BF16) is not captured.

    ``status``: ``recording``, ``ready``, or why not (``off: <reason>``); ``replays``: the
    blocks' forward replays so far. :meth:`remove` (the plugin's teardown) frees the graphs."""

    WAIT = 3  # training forwards to wait for every block's first call before giving up

    def __init__(self, blocks: Sequence[nn.Module], clone_grads: bool = True,
                 compile: bool = False) -> None:
        self.blocks = list(blocks)
        self.clone_grads = clone_grads
        # capture each block's forward compiled (torch.compile around its TE layers): the
        # elementwise work between those layers fuses; a capture that fails compiled is retried
        # with the block's own forward
        self.compile = compile
        self.compiled = False  # the graphs hold compiled forwards
        self.replays = 0
        # FP8 weight caching (delayed scaling, TE's): a replay casts a block's weights only when
        # they may have changed since its last cast (an optimizer step, a load), so the
        # micro-batches of an accumulated step after the first reuse the cast. The flag tensor
        # the graphs read is held here (a later capture without caching clears TE's global
        # reference).
        self.cache_weights = False
        self.recasts = 0  # replays that cast their block's weights
        self._steps = 0  # torch.optim optimizer steps taken since caching began
        self._skip_flag: Optional[torch.Tensor] = None
        self._step_hook: Any = None
        self.fp8: Optional[bool] = None
        self._hooks: list[Any] = []
        self._units: tuple[nn.Module, ...] = ()
        self._fingerprint: tuple = ()
        self._waited = 0
        self._other_state = 0  # training forwards in another FP8 state than the capture's
        self._switched = 0  # recordings whose blocks all ran in another FP8 state than the step
        self._told_eager = False
        self.in_training = False  # inside the plugin's training forward (training_forward)
        self.calls: dict[int, _Call] = {}
        self.order: list[int] = []
        if len({id(b) for b in self.blocks}) != len(self.blocks):
            self.status = "off: a block appears twice in the model's list"
            return
        self._record()

    def _record(self) -> None:
        self.status, self.calls, self.order, self._waited = "recording", {}, [], 0
        self._other_state = 0
        self._hooks = [block.register_forward_pre_hook(self._recorder(i), with_kwargs=True)
                       for i, block in enumerate(self.blocks)]

    def _recorder(self, i: int) -> Callable:
        def record(block: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            if self.in_training and torch.is_grad_enabled() and i not in self.calls and \
                    not torch.compiler.is_compiling():
                self.calls[i] = _Call(args, kwargs, block.training)
                self.order.append(i)
        return record

    @contextmanager
    def training_forward(self) -> Iterator[None]:
        """The plugin's training forward: what is recorded and replayed. Not the blocks'
        ``training`` flag: a Hugging Face model from ``from_pretrained`` trains in ``eval()`` mode
        unless its user calls ``train()`` (a replay still needs the mode of its capture)."""
        before, self.in_training = self.in_training, True
        try:
            yield
        finally:
            self.in_training = before

    def _params(self) -> list[nn.Parameter]:
        return [p for block in self.blocks for p in block.parameters()]

    def _now(self) -> tuple:
        """What a capture depends on: where each parameter (and a fused weight gradient's FP32
        buffer, which the graph's backward writes) lives and whether it trains."""
        return tuple((p.data_ptr(), p.requires_grad, getattr(p, "main_grad", p).data_ptr())
                     for p in self._params())

    def remove(self) -> None:
        """No recording, no graph: the blocks' own forward again, the graphs' memory freed."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for block in self.blocks:
            if block.__dict__.pop(_SLOT, None) is not None:
                block.__dict__.pop("forward", None)
        self.cache_weights_off()
        if self._units:
            release(self._units)
            self._units = ()
            gc.collect()  # the graphed callables' closures hold each other: free their pools now

    @property
    def live(self) -> bool:
        """Recording or captured (not removed)."""
        return bool(self._hooks or self._units)

    def _off(self, why: str) -> None:
        self.remove()
        self.status = f"off: {why}"
        log.info("CUDA graphs of the model's blocks: off (%s)", why)

    def step_end(self) -> None:
        """After an optimizer step: every replay's activations are spent (backpropagated or
        dropped), so the next call of each block may replay again."""
        for block in self.blocks:
            replay = block.__dict__.get(_SLOT)
            if replay is not None:
                replay.in_flight = False

    def before_step(self, step_start: bool = True) -> None:
        """Before a training forward (``step_start``: a new training step, no earlier forward
        awaits its backward): capture once every block's call has been recorded."""
        if self.status == "ready":
            if step_start:
                self.step_end()
            # FP8 off (a BF16 fallback) or on again for several forwards: capture in that state
            self._other_state = self._other_state + 1 if fp8_now() != self.fp8 else 0
            if self._now() == self._fingerprint and self._other_state < self.WAIT:
                return
            log.info("CUDA graphs of the model's blocks: %s since the capture; recording its "
                     "calls again", f"FP8 {'on' if fp8_now() else 'off'}"
                     if self._other_state else "its parameters moved or changed requires_grad")
            self.remove()
            self._record()
        if self.status != "recording":
            return
        if len(self.calls) < len(self.blocks):
            self._waited += 1
            if self._waited > self.WAIT:
                missing = [i for i in range(len(self.blocks)) if i not in self.calls]
                self._off("no block was called outside torch.compile in a training forward"
                          if not self.calls else
                          f"block(s) {', '.join(map(str, missing[:8]))} not called in "
                          f"{self.WAIT} training forwards")
            return
        from torch.distributed.tensor import DTensor

        params = self._params()
        fp8 = fp8_now()
        order = [i for i in self.order if self.calls[i].fp8 == fp8]  # the others run eagerly
        if not order:
            self._switched += 1
            if self._switched <= self.WAIT:  # FP8 switched since the recording (a fallback)
                log.info("CUDA graphs of the model's blocks: FP8 %s since the recording; "
                         "recording their calls again", "on" if fp8 else "off")
                self.remove()
                self._record()
                return
            self._off("no block ran in the FP8 state of the training step")
            return
        why = next((f"block {i}'s call cannot be replayed: {c.unsupported}"
                    for i, c in self.calls.items() if c.unsupported), "")
        why = why or next((f"block {i} has a forward of its own on the instance (a wrapper "
                           "such as accelerate's hooks), which a capture would skip"
                           for i, b in enumerate(self.blocks) if "forward" in b.__dict__), "")
        if not why and (not params or params[0].device.type != "cuda"):
            why = "CUDA graphs need a GPU"
        if not why and any(isinstance(p, DTensor) for p in params):
            why = "FSDP2's hooks run in Python, outside a replay"
        if not why and te_debug_on():
            why = "FP8Stats reads TE's debug hooks, which run in Python, not in a replay"
        if why:
            self._off(why)
            return
        for handle in self._hooks:  # TE captures no module with hooks
            handle.remove()
        self._hooks.clear()
        blocks = [self.blocks[i] for i in order]  # the replays' order, and the pool's
        samples = [self.calls[i].sample(params[0].device) for i in order]

        cache = fp8 and can_cache_weights(fp8_state()[1])

        def capture_blocks(compiled: bool) -> tuple[tuple[nn.Module, ...], list]:
            forwards = [type(b).forward.__get__(b) for b in blocks]
            if compiled:
                forwards = [torch.compile(f, dynamic=False) for f in forwards]
            units = tuple(_BoundBlock(b, f, self.calls[i].fixed)
                          for i, b, f in zip(order, blocks, forwards))
            with dynamo_around(blocks) if compiled else nullcontext():
                return units, capture(units, tuple(a for a, _ in samples), True,
                                      self.clone_grads,
                                      sample_kwargs=tuple(k for _, k in samples),
                                      compiled=compiled, cache_weights=cache)

        try:
            self.compiled = False
            if self.compile:
                try:
                    units, graphed = capture_blocks(True)
                    self.compiled = True
                except Exception as err:  # noqa: BLE001 - the blocks' own forward instead
                    message = (str(err).strip().splitlines() or [""])[0][:300]
                    log.warning("CUDA graphs of the model's blocks: the compiled capture failed "
                                "(%s: %s); capturing their own forward", type(err).__name__,
                                message)
                    gc.collect()
            if not self.compiled:
                units, graphed = capture_blocks(False)
        except Exception as err:  # noqa: BLE001 - training goes on eagerly, and says why
            message = (str(err).strip().splitlines() or [""])[0][:300]
            self.status = f"off: capture failed ({type(err).__name__}: {message})"
            log.warning("CUDA graphs of the model's blocks: capture failed (%s: %s); training "
                        "without them", type(err).__name__, message)
            return
        self.fp8, self._units, self._fingerprint = fp8, units, self._now()
        self.cache_weights = False
        if cache:
            self.cache_weights_on(_te_quantization_state().skip_fp8_weight_update_tensor)
        for i, block, replay in zip(order, blocks, graphed):
            block.__dict__[_SLOT] = _Replay(self, i, self.calls[i], replay, block)
            block.forward = types.MethodType(_captured_forward, block)
        self.status = "ready"
        kept = len(self.blocks) - len(order)
        log.info("CUDA graphs: %d of the model's %d blocks captured, a graph each (%s%s%s)%s",
                 len(order), len(self.blocks), "FP8" if fp8 else "BF16",
                 ", compiled around the TE layers" if self.compiled else "",
                 ", FP8 weights cast once per optimizer step" if cache else "",
                 f"; {kept} ran in another FP8 state (the layer policy) and stay eager"
                 if kept else "")

    def cache_weights_on(self, skip_flag: torch.Tensor) -> None:
        """The graphs cache their FP8 weights and read ``skip_flag`` (TE's) to know when not to
        cast them. Every ``torch.optim`` optimizer step counts as a change of every weight: a
        fused one (``AdamW(fused=True)``) writes them without moving their version counters,
        and one stepped outside Lightning's plugin hooks (Fabric with a raw optimizer, manual
        optimization) is seen too."""
        self.cache_weights_off()
        ref = weakref.ref(self)

        def stepped(*_: Any) -> None:
            owner = ref()
            if owner is not None:
                owner._steps += 1

        self.cache_weights, self._skip_flag = True, skip_flag
        self._step_hook = register_optimizer_step_post_hook(stepped)
        weakref.finalize(self, self._step_hook.remove)

    def cache_weights_off(self) -> None:
        """No optimizer hook, no flag held (the graphs are released)."""
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        self._skip_flag = None

    def weights_cast(self, cast: bool) -> None:
        """Before a replay (weight caching): tell the graphs to cast their weights or reuse the
        last cast. Filled before every replay: TE's graphed callable fills the same tensor for
        the first FP8 module of an autocast region, which need not be a captured block, and
        another run's graphs in this process may share it (stream-ordered: the replays before
        still read the value they were given)."""
        self._skip_flag.fill_(not cast)
        self.recasts += cast

    def tell_eager(self, i: int) -> None:
        """Once a run: a captured block's training call that differs from the recorded one."""
        if not self._told_eager:
            self._told_eager = True
            log.info("CUDA graphs of the model's blocks: block %d was called in training with "
                     "other tensor shapes, dtypes, gradients or options than at its capture; "
                     "such calls run eagerly", i)


_SLOT = "_fp8_lightning_replay"  # a captured block's _Replay, in the block's own __dict__


def _no_replay() -> None:
    return None


class _Replay:
    """One captured block's graph and when it may replay. Held by the block itself: it lives as
    long as the block does. A copy of the block (``copy.deepcopy`` for an EMA, pickling) gets
    none and runs its own forward with its own weights."""

    def __init__(self, owner: ModelBlockGraphs, index: int, call: _Call, graphed: Callable,
                 block: nn.Module) -> None:
        self.owner, self.index, self.call, self.graphed = owner, index, call, graphed
        # TE sets ``module.fp8`` on each Python forward (FP8Precision reads it to verify that FP8
        # ran); a replay runs no Python, so the capture's flags are put back when replays resume.
        self.flags = {m: m.fp8 for m in block.modules() if hasattr(m, "fp8")}
        self.replaying = True
        # weight caching: the optimizer steps and the parameters' version counters (any
        # in-place change through the parameter, e.g. a load, moves them) at the last cast
        self.params = list(block.parameters())
        self.cast_at: Optional[tuple] = None
        # a replay's outputs are the graph's static buffers until its backward has run (or the
        # optimizer step): another call before then (two forwards, one backward) runs eagerly
        self.in_flight = False

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self) -> tuple:
        return _no_replay, ()

    def allows(self, block: nn.Module, args: tuple, kwargs: dict[str, Any]) -> bool:
        if not (self.owner.in_training and torch.is_grad_enabled()) or self.in_flight or \
                block.training != self.call.training or fp8_now() != self.owner.fp8:
            return False
        if self.call.matches(args, kwargs):
            return True
        self.owner.tell_eager(self.index)
        return False

    def __call__(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        if not self.replaying:
            for module, flag in self.flags.items():
                module.fp8 = flag
            self.replaying = True
        self.owner.replays += 1
        tensors = {k: kwargs[k] for k in self.call.tensor_kwargs}
        if self.owner.cache_weights:
            now = (self.owner._steps, *(p._version for p in self.params))
            cast, self.cast_at = now != self.cast_at, now
            self.owner.weights_cast(cast)
            tensors["is_first_microbatch"] = cast  # TE's graphed callable asks for it
        out = self.graphed(*args, **tensors)
        # in flight until the backward, or without one (nothing asks for a gradient) until the
        # step ends: the next call would overwrite these outputs
        self.in_flight = True
        node = next((t.grad_fn for t in torch.utils._pytree.tree_leaves(out)
                     if isinstance(t, torch.Tensor) and t.grad_fn is not None), None)
        if node is not None:
            node.register_hook(self._backward_done)
        return out

    def _backward_done(self, *_: Any) -> None:
        self.in_flight = False


def _captured_forward(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A captured block's ``forward`` (bound to it): the graph's replay where the call allows,
    else the block's own forward."""
    if torch.compiler.is_compiling():  # a model compiled after the capture: traced eagerly
        return type(block).forward(block, *args, **kwargs)
    replay = block.__dict__.get(_SLOT)
    if replay is not None:
        if replay.allows(block, args, kwargs):
            return replay(args, kwargs)
        replay.replaying = False
    return type(block).forward(block, *args, **kwargs)


# pickle stores a bound method as getattr(block, __name__): the unpickled block's own forward
_captured_forward.__name__ = _captured_forward.__qualname__ = "forward"
