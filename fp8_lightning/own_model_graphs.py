"""CUDA graphs of the blocks of a model this package did not build (``Speedups``'
``cuda_graphs`` for a user's ``LightningModule``): each block's calls are recorded during the first
training steps, then each block is captured as its own graph (TE's ``make_graphed_callables``,
through :func:`fp8_lightning.graphs.capture`, the capture the package's own GPT uses) and replayed
while a call matches what was recorded; any other call runs the block eagerly.
"""

from __future__ import annotations

import gc
import logging
import types
import weakref
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from .graphs import (_te_quantization_state, can_cache_weights, capture, fp8_now, fp8_state,
                     graphs_status, release, world_size)
from .te_availability import te_available

log = logging.getLogger(__name__)


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
def te_layers_left_eager(blocks: Sequence[nn.Module],
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
        if not why:  # the plan's rules again, now that the blocks show where they train
            ok, status = graphs_status(params[0].device.type if params else "cpu", world_size(),
                                       sharded=any(isinstance(p, DTensor) for p in params),
                                       whole_step=False)
            why = "" if ok else status
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
            with te_layers_left_eager(blocks) if compiled else nullcontext():
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
