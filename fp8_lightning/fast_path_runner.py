"""The training step's fast path as it runs: :class:`FastPathRunner` holds a module's plan
(:class:`~fp8_lightning.fast_path.FastPath`, decided in :mod:`fp8_lightning.fast_path`) and
applies it to the model: compiles it, captures the blocks' CUDA graphs at the first training
call and replays them after, runs FSDP2's whole step with its backward as one graph
(:mod:`fp8_lightning.step_graph`), and steps a failed compilation back to eager with its reason.
``GPTLightningModule`` keeps one and calls it from its hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from .distributed import is_sharded
from .fast_path import GRAPHS_HOW, FastPath, plan_graphs
from .fp8.plugin import fp8_plugin
from .graphs import prepare_graphs
from .layers import runs_float8
from .model import compile_model, uncompile_model
from .step_graph import StepGraph

if TYPE_CHECKING:
    import lightning as L


class FastPathRunner:
    """One module's fast path: the plan, what it compiled, the graphs it captured."""

    def __init__(self) -> None:
        # What the training step compiles and replays, and why: the compile part when the
        # model is built, the CUDA graphs when training starts.
        self.plan: Optional[FastPath] = None
        self.compiled: Optional[str] = None  # what compile_model compiled (the log's words)
        self.compile_checked = False  # a training step has run compiled
        self.block_graphs: Any = None  # BlockGraphs once captured
        self.step_graph: Optional[StepGraph] = None  # under FSDP2 (fast path "step")
        self.backward_done = False  # the training step ran this micro-batch's backward
        self.cudagraphed = False  # the PyTorch backend compiled with CUDA graphs

    def apply_compile(self, model: nn.Module, wanted: Optional[bool], backend: str) -> None:
        """Apply the compile part of the plan to the model just built, and log it.
        ``wanted``: ``model.compile``."""
        path = self.plan
        if wanted and not path.compile:
            rank_zero_warn(path.compile_why)
        if not path.compile:
            rank_zero_info(f"compile: off ({path.compile_why})" if wanted is None
                           else "compile: off")
            return
        self.compiled = compile_model(model, regions=path.regions, per_block=path.per_block)
        rank_zero_info(f"compile: {self.compiled} (torch.compile; the first steps compile)"
                       + ("" if path.regions or backend != "te" else f"; {path.compile_why}"))

    def plan_graphs(self, model: Optional[nn.Module], trainer: Optional["L.Trainer"], *,
                    wanted: Optional[bool], compile_wanted: Optional[bool], backend: str,
                    device_type: str, activation_checkpointing: str,
                    step_graph_fits: bool) -> FastPath:
        """Decide the CUDA graphs of this run's training step, compile the model for them
        (lazily: the first call compiles), log it. ``wanted``: ``model.cuda_graphs``;
        ``compile_wanted``: ``model.compile``."""
        previous = self.plan.graphs if self.plan is not None else None  # a last fit's
        if self.plan is None:  # a module built without configure_model's plan
            self.plan = FastPath(bool(self.compiled), "compiled by its caller"
                                 if self.compiled else "not compiled")
        path = plan_graphs(
            self.plan, wanted, device_type=device_type, backend=backend,
            world_size=trainer.world_size if trainer is not None else 1,
            sharded=trainer is not None and is_sharded(trainer.strategy),
            callbacks=trainer.callbacks if trainer is not None else [],
            accumulate_grad_batches=trainer.accumulate_grad_batches if trainer is not None else 1,
            activation_checkpointing=activation_checkpointing,
            runs_float8=model is not None and runs_float8(model),
            step_graph_fits=step_graph_fits)
        if wanted and path.graphs is None:
            rank_zero_warn(f"{path.graphs_why}; running without")
        rank_zero_info("CUDA graphs: " + (f"on, {GRAPHS_HOW[path.graphs]}" if path.graphs else
                                          "off" if wanted is False else f"off ({path.graphs_why})"))
        self.plan = path
        self.compile_checked = False  # each fit checks its first compiled step
        plugin = fp8_plugin(trainer) if trainer is not None else None
        if plugin is not None:
            # a whole-step graph must hold the autocast's exit (TE's amax reduction): the step
            # opens it around its own forward, not the plugin around the training step
            plugin.step_owns_autocast = path.graphs == "step"
        if model is None:
            return path
        torch_per_block = backend != "te" and path.graphs == "per-block"
        if path.graphs == "inductor":
            self.compiled, self.cudagraphed = compile_model(model, cuda_graphs=True), True
        elif torch_per_block:
            # the blocks compiled one by one, to be captured each (the whole model's graph
            # would hold DDP's all-reduce hooks inside it)
            uncompile_model(model)
            self.compiled, self.cudagraphed = compile_model(model, per_block=True), False
            rank_zero_info(f"compile: {self.compiled}, for a CUDA graph per block")
        elif self.cudagraphed or (backend != "te" and previous == "per-block"):
            # a last fit compiled for graphs this fit has not: the plan's own compile again
            uncompile_model(model)
            self.compiled, self.cudagraphed = None, False
            self.apply_compile(model, compile_wanted, backend)
        return path

    def drop_graphs(self) -> None:
        """A fit captures its own graphs: a previous fit's (a notebook's second ``fit``) read
        the parameters where they were then (Lightning moves the module to the CPU at the end
        of a fit) and were captured under that fit's plugin (recipe, amax group), accumulation
        and strategy; they are freed (what the model is compiled for is plan_graphs')."""
        graphs, self.block_graphs = self.block_graphs, None
        if hasattr(graphs, "release"):  # captured (not None, not a failed capture)
            graphs.release()
        if self.step_graph is not None:
            self.step_graph.remove()
            self.step_graph = None

    def graphed(self, model: nn.Module) -> Optional[str]:
        """What the CUDA graphs replay now: ``"FP8"``, ``"BF16"`` or None (see
        ``GPTLightningModule.graphed``)."""
        if self.cudagraphed:
            return "FP8" if runs_float8(model) else "BF16"
        if self.step_graph is not None:
            key = self.step_graph.replaying
            return None if key is None else "FP8" if key[-1] else "BF16"
        graphs = self.block_graphs
        if graphs is None or not graphs.active:
            return None
        return "FP8" if graphs.key[-1] else "BF16"

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, training: bool,
             trainer: Optional["L.Trainer"]) -> torch.Tensor:
        """The model's loss on inputs ``x`` and targets ``y``, through the planned graphs."""
        # The plan (plan_graphs) is applied here, not decided: the blocks' graphs are captured
        # at the first training call, which has the micro-batch shape.
        graphs = self.plan.graphs if training and self.plan is not None else None
        if graphs in ("blocks", "per-block"):
            self.block_graphs = prepare_graphs(self.block_graphs, model, tuple(x.shape),
                                               trainer.accumulate_grad_batches if trainer else 1,
                                               per_block=graphs == "per-block")
        loss = self.model_loss(model, x, y, training=training)
        # A replay's outputs live in the CUDA graphs' memory pool, which the next replay
        # overwrites: the loss that Lightning logs and keeps is a copy.
        return loss.clone() if self.cudagraphed else loss

    def model_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                   training: bool) -> torch.Tensor:
        """The model's loss; the first compiled training call steps back to eager, with its
        reason, where the compilation fails."""
        if not self.compiled or self.compile_checked:
            return model(x, y)
        try:
            loss = model(x, y)
        except Exception as err:  # noqa: BLE001 - a failed compilation falls back, said why
            uncompile_model(model)
            self.compiled = None
            message = " ".join(str(err).split())[:300]
            why = f"torch.compile failed ({type(err).__name__}: {message})"
            self.plan = self.plan.without_compile(why) if self.plan else None
            rank_zero_warn(f"compile: {why}; training eagerly")
            loss = model(x, y)
            self.cudagraphed = False
        self.compile_checked = training
        return loss

    def step_with_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                           trainer: "L.Trainer", *, training: bool) -> torch.Tensor:
        """The fast path ``"step"``: forward and backward of a micro-batch in one CUDA graph,
        the forward in the precision plugin's autocast. The loss."""
        precision = trainer.precision_plugin
        accumulate = trainer.accumulate_grad_batches

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with precision.forward_context():
                loss = self.model_loss(model, x, y, training=training)
            (loss / accumulate).backward()  # as Lightning scales an accumulated micro-batch
            return loss.detach()

        if self.step_graph is None:
            self.step_graph = StepGraph(model)
        plugin = fp8_plugin(trainer)
        # (the divisor is baked into a captured backward: another one is another graph)
        key = (tuple(x.shape), accumulate, plugin is not None and plugin.fp8_active)
        loss = self.step_graph(step, x, y, key)
        self.backward_done = True
        return loss
