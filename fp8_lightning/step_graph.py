"""The whole training step's forward and backward as one CUDA graph: the fast path under FSDP2.

Why: under FSDP2 a TE step is host-bound (TE issues its kernels from Python, FSDP2 gathers and
reduces in Python hooks), and a block's own graph, the DDP path's, cannot replay there: FSDP2
gathers a block's weights into storage it frees and allocates again every step, so a replay would
read where they were. A graph of the whole forward and backward holds FSDP2's all-gathers and
reduce-scatters as well, their buffers in the graph's own memory pool at fixed addresses, and TE's
amax reduction at the autocast's exit (torchtitan captures FSDP2 steps so:
pytorch/torchtitan#3559). The host launches one graph per micro-batch.

Outside the graph, eager between replays: the optimizer, gradient clipping, logging. The gradients
stay allocated (zeroed in place after each optimizer step, not dropped): the captured
reduce-scatters add into the same ``.grad`` memory at every replay.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import weakref
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.utilities import rank_zero_only
from torch import nn

log = logging.getLogger(__name__)

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, y) -> loss, backward done


class StepGraph:
    """A micro-batch's forward and backward (``step``), captured at the second call with the same
    key (micro-batch shape, accumulation, FP8 on or off; the first warms up eagerly: compiled
    pieces, NCCL and cuBLAS on these shapes) and replayed after; another key runs eagerly and is
    captured anew. A capture that fails stops the run, saying how to train without it."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.key: Optional[tuple] = None
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.inputs: tuple[torch.Tensor, ...] = ()
        self.loss: Optional[torch.Tensor] = None
        # (parameter, the gradient tensor the graph adds into), from the capture
        self.grads: list[tuple[nn.Parameter, torch.Tensor]] = []
        # An eager forward between replays (validation, a text sample) leaves the units that keep
        # their weights after forward gathered, and FSDP2 believing so: the next step runs eagerly,
        # so that FSDP2's own backward frees them, as the replays expect (a replay would leave
        # them gathered, and the next eager forward would read weights some steps old).
        self.eager_next = False
        self.freed = False  # free() dropped a graph of ``key``
        self._stepping = False
        self._hook = model.register_forward_pre_hook(self._seen_forward)
        # For a run that ends without the module's teardown (an exception, a SIGTERM stop): at
        # exit, before Lightning's process-group destroy, which was registered earlier (at the
        # process group's start; atexit runs the last registered first).
        atexit.register(_free_at_exit, weakref.ref(self))

    def _seen_forward(self, *_: Any) -> None:
        if not self._stepping:
            self.eager_next = True

    @property
    def replaying(self) -> Optional[tuple]:
        """The key the graph replays (captured), or None; after :meth:`free`, the key it
        replayed until then."""
        return self.key if self.graph is not None or self.freed else None

    def __call__(self, step: Step, x: torch.Tensor, y: torch.Tensor, key: tuple) -> torch.Tensor:
        self._stepping = True
        try:
            return self._step(step, x, y, key)
        finally:
            self._stepping = False

    def _step(self, step: Step, x: torch.Tensor, y: torch.Tensor, key: tuple) -> torch.Tensor:
        if x.device.type != "cuda":  # (graphs need a GPU; the eager step computes the same)
            return step(x, y)
        if key != self.key:  # first use, or another shape / FP8 state: eager, captured next time
            self.release()
            self.key, self.eager_next = key, False
            # on the tensors the graph will read: the same strides, so that nothing compiled
            # (the loss) compiles again inside the capture
            self.inputs = (x.clone(), y.clone())
            return step(*self.inputs)
        self.inputs[0].copy_(x)
        self.inputs[1].copy_(y)
        self._keep_grads()
        if self.eager_next:
            self.eager_next = False
            return step(*self.inputs)
        if self.graph is None:
            self._capture(step, x)
        self.graph.replay()
        return self.loss.clone()  # the next replay overwrites the graph's own

    def _keep_grads(self) -> None:
        """Put the captured gradient tensors back on their parameters, before any step of this
        key, eager ones included. Lightning drops every gradient before a validation
        (``on_validation_model_zero_grad``): FSDP2's next eager backward would then give each
        parameter a new gradient, a view of its reduce-scatter's output, while the replays go on
        adding into the captured tensors, which are no longer the parameters' gradients."""
        for param, grad in self.grads:
            current = param.grad
            if current is not grad:
                grad.zero_() if current is None else grad.copy_(current)
                param.grad = grad

    def _capture(self, step: Step, x: torch.Tensor) -> None:
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        try:
            # thread_local: NCCL's watchdog thread polls its events meanwhile, which is legal
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.loss = step(*self.inputs)
        except Exception as err:
            # Not eager from here: the step stopped halfway through FSDP2's gathers and TE's
            # amax bookkeeping, and the other ranks may have captured theirs. The half-captured
            # graph is reset first: the traceback keeps it alive, and its NCCL work outliving
            # the process group would hang the exit (see free).
            with contextlib.suppress(Exception):
                graph.reset()
            message = " ".join(str(err).split())[:300]
            raise RuntimeError(f"capturing the training step as a CUDA graph failed "
                               f"({type(err).__name__}: {message}); model.cuda_graphs: false "
                               "trains without it") from err
        self.graph, self.freed = graph, False
        self.grads = [(p, p.grad) for p in self.model.parameters() if p.grad is not None]
        rank_zero_only(log.info)("CUDA graphs: the step's forward and backward captured for "
                                 "micro-batch %s (%s)", "x".join(map(str, x.shape)),
                                 "FP8" if self.key[-1] else "BF16")

    def release(self) -> None:
        """Free the graph and its memory pool (training goes on eagerly until captured again)."""
        self.graph, self.inputs, self.loss, self.key, self.grads = None, (), None, None, []
        self.freed = False

    def free(self) -> None:
        """At the end of a fit, or at exit: free the graph and its pool before the process group
        goes (Lightning destroys it at exit). A graph holding NCCL collectives outliving its
        communicator hangs the process's exit (pytorch/torchtitan#2050 frees its graphs so)."""
        graph, self.graph, self.loss = self.graph, None, None
        if graph is not None:
            self.freed = True
            # (a run that failed on the GPU raises its error again here: that one is reported
            # already, and must not hide it nor keep the graph)
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()  # a replay may still run
            with contextlib.suppress(Exception):
                graph.reset()

    def remove(self) -> None:
        """:meth:`release`, and stop watching the model's forward."""
        self.release()
        self._hook.remove()


def _free_at_exit(ref: "weakref.ref[StepGraph]") -> None:
    step = ref()
    if step is not None:
        step.free()
