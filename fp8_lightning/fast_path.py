"""The training step's fast path: ``torch.compile`` and CUDA graphs, each decided once with why,
in one typed result (:class:`FastPath`) that ``GPTLightningModule`` follows and logs through
:class:`~fp8_lightning.fast_path_runner.FastPathRunner`.

Two moments, both before a run's first step: the compile decision when the model is built
(``configure_model``: the layers exist, the strategy is known), the CUDA graphs when training
starts (``on_train_start``, or ``measure.build_step`` for ``bench``: after the FP8 plugin has
converted the model, which decides whether the PyTorch backend runs float8). The training step
only applies the plan: capturing graphs needs the first micro-batch's shape, and a failed
compilation or capture steps back to eager with its reason (``FastPath.without_compile``).
The model backend (TE or PyTorch layers, ``engine: auto``'s measurement included) is decided
before both, when the module follows the FP8 engine (``GPTLightningModule._follow_fp8_engine``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, Optional

from .graphs import graphs_status, te_primes_after_warmup

Graphs = Literal["blocks", "per-block", "inductor", "step", "recorded"]


def compile_status(device_type: str) -> tuple[bool, str]:
    """Can ``torch.compile`` train here, and why (not): needs dynamo, and Triton on a GPU."""
    try:
        import torch._dynamo

        if not torch._dynamo.is_dynamo_supported():
            return False, "torch.compile is not supported on this platform"
        if device_type == "cuda":
            from torch.utils._triton import has_triton

            if not has_triton():
                return False, "Triton is not installed (torch.compile needs it on a GPU)"
    except Exception as err:  # noqa: BLE001 - any failure to import dynamo is the reason
        return False, f"torch.compile is unavailable: {type(err).__name__}: {err}"
    return True, "torch.compile works here"


@dataclass(frozen=True)
class FastPath:
    """What a run's training step compiles and replays, and why.

    Attributes:
        compile: ``torch.compile`` on.
        compile_why: why it is on or off (the log's words).
        regions: on the TE backend, the regions between TE modules are compiled too (else only
            the loss; the PyTorch backend compiles model and loss whole, or block by block
            for ``"per-block"`` graphs).
        per_block: the PyTorch backend compiles each block and the loss on their own, not the
            whole model: under FSDP2, so that each block is compiled before it is sharded and
            FSDP2's gather and reduce hooks stay outside its graph (torchtitan's layout; the
            whole model compiled around the sharded blocks breaks its graph at every hook).
        graphs: ``"blocks"`` (TE: the block stack as one CUDA graph), ``"per-block"`` (under
            DDP: one graph per block, so each block's all-reduce overlaps the next backward; on
            the PyTorch backend each block compiled, then captured), ``"inductor"`` (PyTorch
            backend, one GPU: the compiled model in Inductor's CUDA graphs), ``"step"`` (TE under
            FSDP2: a micro-batch's whole forward and backward as one graph, FSDP2's collectives
            inside it, :mod:`fp8_lightning.step_graph`), ``"recorded"`` (a model this package
            did not build: a graph per block, recorded from its first training step's calls,
            :class:`~fp8_lightning.own_model_graphs.ModelBlockGraphs`), or None: no graphs (not
            decided yet, or off).
        graphs_why: why (not), once decided.
    """

    compile: bool
    compile_why: str
    regions: bool = True
    per_block: bool = False
    graphs: Optional[Graphs] = None
    graphs_why: Optional[str] = None

    @property
    def graphs_decided(self) -> bool:
        return self.graphs_why is not None

    def without_compile(self, why: str) -> "FastPath":
        """After a failed compilation: eager, with the reason (Inductor's graphs go with it)."""
        return replace(self, compile=False, compile_why=why,
                       graphs=None if self.graphs == "inductor" else self.graphs,
                       graphs_why=why if self.graphs == "inductor" else self.graphs_why)


def plan_compile(wanted: Optional[bool], device_type: str, backend: str = "torch",
                 sharded: bool = False) -> FastPath:
    """``model.compile`` (None: the default) on ``device_type`` for ``backend``'s layers, sharded
    by FSDP2 or not: compile or not, what, and why.

    Default: on a GPU where ``torch.compile`` works; off on a CPU (compiling costs a short CPU
    run more than it saves). Under FSDP2 the PyTorch backend compiles each block on its own
    before sharding (``per_block``); on TE only the loss is compiled by default, the blocks
    replayed uncompiled inside the step's CUDA graph (``"step"``: their compiled regions have
    not been measured there; eager, without the graph, they made the step slower).
    """
    ok, why = compile_status(device_type)
    te_under_fsdp2 = backend == "te" and sharded
    per_block = backend != "te" and sharded
    if wanted is None:
        on = ok and device_type == "cuda"
        if ok and device_type != "cuda":
            why = ("compilation costs a short CPU run more than it saves; model.compile: true to "
                   "compile")
        elif on and te_under_fsdp2:
            why = ("under FSDP2 the TE blocks run uncompiled in the step's CUDA graph "
                   "(model.compile: true compiles their regions too)")
        return FastPath(on, why, regions=not te_under_fsdp2, per_block=per_block)
    if wanted and not ok:
        return FastPath(False, f"model.compile=true but {why}; training eagerly")
    return FastPath(bool(wanted), "model.compile: true" if wanted else "model.compile: false",
                    per_block=per_block)


def plan_graphs(path: FastPath, wanted: Optional[bool], *, device_type: str, backend: str,
                world_size: int = 1, sharded: bool = False, callbacks: Any = (),
                accumulate_grad_batches: int = 1, activation_checkpointing: str = "none",
                runs_float8: bool = False, step_graph_fits: bool = True) -> FastPath:
    """``model.cuda_graphs`` (None: wherever they run) for a run of this shape: ``path`` with
    its graphs decided. ``runs_float8``: the PyTorch backend's layers run torchao float8.
    ``step_graph_fits``: the memory estimate leaves room for FSDP2's step graph (its memory pool
    stays held while an eager step after a validation allocates its own activations)."""
    # (the PyTorch backend's step under FSDP2 is not captured: its compiled blocks kept the GPU's
    # launch queue full, not measured faster)
    ok, why = graphs_status(device_type, world_size, callbacks, sharded, whole_step=backend == "te")
    if ok and sharded and activation_checkpointing == "full":
        # te.checkpoint saves the CUDA RNG state in forward, which a capture forbids
        ok, why = False, ("full activation checkpointing saves the CUDA RNG state, which a "
                          "captured step cannot (mlp can)")
    elif ok and sharded and not step_graph_fits:
        ok, why = False, ("the step's graph holds its memory beside the eager step after each "
                          "validation, which the memory estimate says does not fit")
    elif ok and backend != "te":
        ok, why = _inductor_graphs_status(path, wanted, world_size, accumulate_grad_batches,
                                          runs_float8)
    if ok and activation_checkpointing != "none" and not sharded:
        # (a block's graph; the whole step's graph holds the recompute as it holds the backward)
        ok, why = False, ("activation checkpointing runs a block's forward again inside the "
                          "backward, which a block's captured graph does not")
    if wanted is False:
        return replace(path, graphs=None, graphs_why="model.cuda_graphs: false")
    if not ok:
        return replace(path, graphs=None,
                       graphs_why=f"model.cuda_graphs=true but {why}" if wanted else why)
    kind: Graphs = ("step" if sharded else "per-block" if world_size > 1
                    else "inductor" if backend != "te" else "blocks")
    return replace(path, graphs=kind, graphs_why=why)


def plan_model_graphs(cuda_graphs: Optional[bool], compile_blocks: Optional[bool], *,
                      device_type: str, engine: str, world_size: int, blocks: int) -> FastPath:
    """The plan for a model this package did not build (``Speedups``' ``cuda_graphs`` and
    ``compile_blocks``, None: their defaults): its ``blocks`` repeated modules replayed a graph
    each (``"recorded"``), each capture compiled around its TE layers or not. The rules every
    model shares are :func:`~fp8_lightning.graphs.graphs_status`'s; FSDP2 shows only once the
    blocks hold sharded parameters, so the capture asks it again then."""
    if engine != "te":
        ok, why = False, f"the {engine} engine's modules are not captured; the TE engine's are"
    else:
        ok, why = graphs_status(device_type, world_size, whole_step=False)
        if ok and not blocks:
            ok, why = False, "no repeated blocks (an nn.ModuleList) found"
    if cuda_graphs is False or not ok:
        why = "cuda_graphs: false" if cuda_graphs is False else why
        return FastPath(False, f"it compiles the blocks' captures, and there are none ({why})",
                        per_block=True, graphs=None,
                        graphs_why=f"cuda_graphs=true but {why}" if cuda_graphs else why)
    if compile_blocks is not None:
        compile, compile_why = compile_blocks, f"compile_blocks: {str(compile_blocks).lower()}"
    elif world_size > 1:  # measured on one GPU
        compile, compile_why = False, "several ranks (measured on one GPU; compile_blocks: true)"
    elif not te_primes_after_warmup():
        compile, compile_why = False, ("this TE's make_graphed_callables has no post_warmup_hook "
                                       "to prime a compiled capture")
    else:
        compile, compile_why = True, "one rank: each block's capture compiled around its TE layers"
    return FastPath(compile, compile_why, per_block=True, graphs="recorded", graphs_why=why)


def _inductor_graphs_status(path: FastPath, wanted: Optional[bool], world_size: int,
                            accumulate_grad_batches: int, runs_float8: bool) -> tuple[bool, str]:
    """Can the PyTorch backend replay its compiled step as CUDA graphs here, and why (not)."""
    if not path.compile:
        return False, "the PyTorch backend replays CUDA graphs through torch.compile, which is off"
    if accumulate_grad_batches > 1:
        # The backward graph's gradients live in its memory pool, which the next
        # micro-batch's replay overwrites while they are being accumulated into.
        return False, "gradient accumulation would accumulate into the graphs' own memory"
    if world_size > 1:
        if runs_float8:
            # A BF16 fallback swaps torchao's layers back to nn.Linear, under a captured graph.
            return False, ("torchao float8 under DDP: the model is compiled whole, DDP's "
                           "all-reduce between its compiled pieces")
        # Inductor's own graphs cannot hold DDP's all-reduce hooks; a graph per compiled block
        # leaves them between the replays, as on the TE path (measured faster than the whole
        # model's graph: docs/benchmarks.md, several GPUs).
        return True, "DDP, a compiled graph per block"
    if not runs_float8 and wanted is None:
        return False, ("BF16 on the PyTorch backend is compiled without them (measured: "
                       "no gain); model.cuda_graphs: true to try")
    return True, "one GPU"


GRAPHS_HOW = {"blocks": "the blocks (TE make_graphed_callables)",
              "per-block": "a graph per block (make_graphed_callables)",
              "inductor": "the compiled model (torch.compile mode reduce-overhead)",
              "step": "the step's forward and backward as one graph (FSDP2's collectives in it)",
              "recorded": "a graph per block, recorded from the first training step's calls"}
