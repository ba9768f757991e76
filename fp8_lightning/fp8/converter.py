"""What a model gets at set-up besides its FP8 layers: the interface of ``FP8Precision``'s
``converter`` (:class:`fp8_lightning.Speedups` is the package's).

The plugin owns FP8: the recipe, the layer policy, the engine's layer swap, the fallback and the
check that FP8 ran. What makes a model fast apart from that (CUDA graphs of its blocks, compiled
blocks, fused MLPs, FP32 weight gradients, the attention backend) is a converter the plugin
applies to the model it converts and calls around the forwards and backwards it runs, as
torchtitan applies its model converters. Every hook here does nothing.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch import nn


class ModelConverter:
    """Applied by the FP8 plugin at set-up; subclass and override the hooks you need."""

    def engine_options(self, model: nn.Module, engine: str) -> dict[str, Any]:
        """Keyword arguments for the engine's layer swap (TE: ``fuse_mlp``)."""
        return {}

    def convert(self, model: nn.Module, *, engine: str, fp8: bool, weights: str,
                swapped: list[nn.Module]) -> None:
        """After set-up: ``model`` converted to FP8 by ``engine`` (``swapped``: the layers it put
        in), or running BF16 (``fp8`` false: the fallback)."""

    def context(self) -> AbstractContextManager:
        """Around every forward and backward the plugin runs."""
        return nullcontext()

    def training_forward(self, step_start: bool) -> AbstractContextManager:
        """Around a training forward (``step_start``: the first of a training step)."""
        return nullcontext()

    def before_backward(self) -> None:
        """Before a training backward."""

    def step_end(self) -> None:
        """After an optimizer step that no training-step hook announces (Fabric)."""

    def teardown(self) -> None:
        """At the end of a run: what the set-up made goes, the converter's status stays."""
