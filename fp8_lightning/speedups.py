"""What makes a model this package did not build fast under ``FP8Precision``: a converter
(``FP8Precision(converter=Speedups())``) applied at set-up, after the FP8 layer swap.

This package's GPT has its own fast path (``model.compile``, ``model.cuda_graphs``:
:mod:`fp8_lightning.fast_path`); a user's module or a Hugging Face model gets these instead.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any, Iterator, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import nn
from typing_extensions import override

from .config import ConfigError
from .fp8.attention import cudnn_first, cudnn_is_first, prefer_cudnn, settle_order
from .fp8.converter import ModelConverter
from .fp8.policy import repeated_blocks
from .fp8.wgrad import FusedWgrad, fused_wgrad_blocker, weight_params
from .fast_path import FastPath, plan_model_graphs
from .graphs import world_size

log = logging.getLogger(__name__)
_info = rank_zero_only(log.info)


class Speedups(ModelConverter):
    """CUDA graphs of the blocks, compiled blocks, fused MLPs, FP32 weight gradients and cuDNN
    attention for a model this package did not build. Each option's default (``None``) turns it
    on where it can run and where it was measured faster, said in the log; ``false`` turns it
    off, ``true`` asks for it where the default would not (several ranks).

    Args:
        cuda_graphs: TE engine: replay each of the model's transformer blocks (its repeated
            ``nn.ModuleList``) as a CUDA graph, captured at the second training step from the
            first one's calls (:class:`~fp8_lightning.own_model_graphs.ModelBlockGraphs`; a
            swapped ``te.Linear`` costs more host time than GPU time). Default: on where it can
            run (a GPU, no FSDP2, blocks called with tensors and fixed options); a block it
            cannot replay runs eagerly, said why. With ``delayed`` a block's FP8 weights are
            cast only after an optimizer step or an in-place write through a parameter, so the
            micro-batches of an accumulated step after the first reuse the cast.
        compile_blocks: with ``cuda_graphs``: each block's forward is captured
            ``torch.compile``'d, its TE layers' calls left to TE, so the elementwise work between
            them (norms, RoPE, activations, residual adds) fuses; a compiled capture that fails
            falls back to the block's own forward, said in the log. Default: on where the blocks
            are graphed, the run has one rank and TE can prime a capture after its warm-up.
        fuse_mlp: TE engine: each block's ``nn.LayerNorm -> nn.Linear -> GELU (tanh) ->
            nn.Linear`` whose outputs feed only the next call becomes one ``te.LayerNormMLP``
            holding the same parameters (:mod:`~fp8_lightning.fp8.mlp_fusion`). Checkpoints keep
            the model's keys; a pickled model (``torch.save(model)``) does not load, a state
            dict does. Default: on where the run has one rank.
        fuse_wgrad_accumulation: TE engine, no process group, ``weights: bf16-mixed``: each
            swapped layer's weight-gradient GEMM accumulates in FP32 straight into a buffer that
            is the weight's ``.grad`` (:mod:`~fp8_lightning.fp8.wgrad`). Every such weight then
            gets a gradient each backward, zero where a step skips its layer: set ``false`` for
            a model that skips layers (routed experts, LayerDrop). Default: on where it can run.
        cudnn_attention: the forwards and backwards the plugin runs try cuDNN's fused attention
            first for ``F.scaled_dot_product_attention`` (PyTorch may pick FlashAttention 2 for
            an eager model). Only an order: a call cuDNN cannot serve takes the next backend.
            Default: on for Hopper GPUs with a cuDNN newer than 9.15.0 (older ones had memory
            errors, pytorch/pytorch#169849).
    """

    def __init__(self, cuda_graphs: Optional[bool] = None, compile_blocks: Optional[bool] = None,
                 fuse_mlp: Optional[bool] = None, fuse_wgrad_accumulation: Optional[bool] = None,
                 cudnn_attention: Optional[bool] = None) -> None:
        options = dict(cuda_graphs=cuda_graphs, compile_blocks=compile_blocks, fuse_mlp=fuse_mlp,
                       fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                       cudnn_attention=cudnn_attention)
        problems = [f"{key}={value!r}; valid: true, false (or unset)"
                    for key, value in options.items()
                    if value is not None and not isinstance(value, bool)]
        if problems:
            raise ConfigError(problems, "Speedups")
        self.cuda_graphs, self.compile_blocks = cuda_graphs, compile_blocks
        self.fuse_mlp, self.fuse_wgrad_accumulation = fuse_mlp, fuse_wgrad_accumulation
        self.cudnn_attention = cudnn_attention
        self.cudnn_first = False
        self.wgrad: Optional[FusedWgrad] = None
        self.graphs: Any = None  # ModelBlockGraphs
        self.path: Optional[FastPath] = None  # what the graphs plan decided, and why

    @staticmethod
    def _own_gpt(model: nn.Module) -> bool:
        from .model import GPT

        return isinstance(model, GPT)

    @override
    def engine_options(self, model: nn.Module, engine: str) -> dict[str, Any]:
        if engine != "te" or self._own_gpt(model):
            asked = [name for name in ("fuse_mlp", "compile_blocks") if getattr(self, name)]
            if asked:
                _info("%s: off (%s)", ", ".join(asked),
                      "this package's GPT fuses its MLPs and graphs its blocks itself"
                      if self._own_gpt(model) else f"engine {engine}: they act on the TE "
                      "engine's layers; the torchao engine compiles the whole model")
            return {}
        # measured on one GPU; on several ranks only where asked for
        return {"fuse_mlp": False if self.fuse_mlp is None and world_size() > 1 else self.fuse_mlp}

    @override
    def convert(self, model: nn.Module, *, engine: str, fp8: bool, weights: str,
                swapped: list[nn.Module]) -> None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self._plan_attention(model, device_type)
        if fp8:
            self._plan_wgrad(model, engine, weights, swapped)
            self._plan_graphs(model, engine, device_type)
        else:  # BF16 (the fallback): no plan of FP8's graphs stands
            self.path = None

    def _plan_attention(self, model: nn.Module, device_type: str) -> None:
        """cuDNN's attention first in the forwards of a model this package did not build."""
        self.cudnn_first = False
        if self._own_gpt(model):  # it picks its attention with model.attention
            return
        capability = torch.cuda.get_device_capability() if device_type == "cuda" else None
        cudnn, clash = None, ""
        if device_type == "cuda" and torch.backends.cudnn.is_available():
            try:
                cudnn = torch.backends.cudnn.version()
            except RuntimeError as err:  # a cuDNN other than PyTorch's was loaded first
                clash = str(err).splitlines()[0]
                rank_zero_only(log.warning)("cuDNN unusable, PyTorch's attention order kept: %s",
                                            clash)
        self.cudnn_first, why = prefer_cudnn(self.cudnn_attention, device_type, capability, cudnn)
        if clash:  # even where cudnn_attention=true asked for it
            self.cudnn_first, why = False, "cuDNN unusable"
        said = "cuDNN's attention first"
        if self.cudnn_first:
            settle_order(torch.device("cuda", torch.cuda.current_device()))
            if cudnn_is_first():  # nothing to change: said, as it is what runs
                self.cudnn_first, why = False, "PyTorch's own order"
        elif self.cudnn_attention is not None or device_type == "cuda":
            said = "PyTorch's order"
        else:
            return  # a CPU, nothing asked: nothing to say
        _info("scaled_dot_product_attention: %s (%s)", said, why)

    def _plan_wgrad(self, model: nn.Module, engine: str, weights: str,
                    swapped: list[nn.Module]) -> None:
        """``fuse_wgrad_accumulation``: the swapped TE layers sum their weight gradients in FP32."""
        if self.wgrad is not None:
            self.wgrad.remove()
            self.wgrad = None
        if self.fuse_wgrad_accumulation is False:
            return
        why = ("the torchao engine's layers stay nn.Linear" if engine != "te" else
               "this package's GPT" if self._own_gpt(model) else "")
        if why and self.fuse_wgrad_accumulation is None:
            return  # not asked for, and nothing of it applies here: nothing to say
        modules = []
        if not why:  # the layers the engine swapped in (not TE layers the user built)
            here = set(model.modules())
            params = {m: weight_params(m) for m in swapped if m in here}
            modules = [m for m, ws in params.items() if ws and all(
                w.requires_grad and w.dtype == torch.float32 for w in ws)]
            group = torch.distributed.is_available() and torch.distributed.is_initialized()
            why = fused_wgrad_blocker(weights, group,
                                      [w for m in modules for w in params[m]]) or ""
        if why:
            _info("fuse_wgrad_accumulation: off (%s)", why)
            return
        self.wgrad = FusedWgrad(modules)
        _info("fuse_wgrad_accumulation: %d TE layers sum their weight gradient in FP32 "
              "main_grad, which is their .grad", len(modules))

    def _plan_graphs(self, model: nn.Module, engine: str, device_type: str) -> None:
        """CUDA graphs of the converted model's blocks, as :func:`~fp8_lightning.fast_path.
        plan_model_graphs` decides."""
        from .own_model_graphs import ModelBlockGraphs

        if self.graphs is not None:  # set up again: the same model's live graphs stay (they
            # record again if its parameters moved meanwhile); after a teardown, new ones
            if self.graphs.live and self.graphs.blocks[0] in set(model.modules()):
                return
            self.graphs.remove()
            self.graphs = None
        self.path = None
        if self._own_gpt(model):
            if self.cuda_graphs:
                _info("CUDA graphs of the model's blocks: off (this package's GPT graphs its "
                      "blocks itself: model.cuda_graphs)")
            return
        blocks = repeated_blocks(model) if engine == "te" else []
        self.path = plan_model_graphs(self.cuda_graphs, self.compile_blocks,
                                      device_type=device_type, engine=engine,
                                      world_size=world_size(), blocks=len(blocks))
        if self.path.graphs is None:
            if self.cuda_graphs:  # asked for: say why not (unasked, the default stays quiet)
                _info("CUDA graphs of the model's blocks: off (%s)", self.path.graphs_why)
            if self.compile_blocks and engine == "te":  # (engine_options said it for the others)
                _info("compile_blocks: off (%s)", self.path.compile_why)
            return
        self.graphs = ModelBlockGraphs(blocks, compile=self.path.compile)

    @override
    def context(self) -> Any:
        # the forward's attention order for an activation checkpoint's recompute too: another
        # backend there would save other tensors than the forward did
        return cudnn_first() if self.cudnn_first else nullcontext()

    @override
    @contextmanager
    def training_forward(self, step_start: bool) -> Iterator[None]:
        with ExitStack() as stack:
            if self.wgrad is not None:
                self.wgrad.before_forward()  # before a capture: the graph writes main_grad
            if self.graphs is not None:
                self.graphs.before_step(step_start)
                stack.enter_context(self.graphs.training_forward())
            yield

    @override
    def before_backward(self) -> None:
        if self.wgrad is not None:
            self.wgrad.before_backward()

    @override
    def step_end(self) -> None:
        if self.graphs is not None:
            self.graphs.step_end()

    @override
    def teardown(self) -> None:
        # the graphs' memory pools go with the run; the object stays, with its status and replays
        if self.graphs is not None:
            self.graphs.remove()
        if self.wgrad is not None:
            self.wgrad.remove()
            self.wgrad = None
