"""What an FP8 engine does for the precision plugin, and how the plugin finds one.

The plugin (:mod:`.plugin`) owns what is the same for every engine: the recipe's validation, the
layer policy, the FP8-active switch and its history, the fallback to BF16 with a reason, the
checkpoint state. An engine owns what differs: whether it can run here, which modules are its
GEMMs, how they are made FP8 and switched, the forward context, and scaling state as plain
tensors.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Optional

from torch import nn


class Engine:
    """The interface; :class:`~.te_engine.TEEngine` and :class:`~.torchao_engine.TorchaoEngine`
    implement it."""

    name = ""
    backend = ""  # the model backend whose layers this engine converts
    # convert() replaces a model's modules (TE: te.Linear for nn.Linear), not only their
    # forward: FSDP2 must shard the model after it (FSDP2 gathers into the modules it saw)
    swaps_modules = False

    def available(self, recipe: str) -> tuple[bool, str]:
        """Can ``recipe`` run here: (yes/no, the device, or why not)."""
        raise NotImplementedError

    def gemm_modules(self, model: nn.Module) -> dict[str, nn.Module]:
        """The named modules that run GEMMs this engine can run in FP8."""
        raise NotImplementedError

    def cannot_convert(self, model: nn.Module) -> Optional[str]:
        """Why this engine cannot make ``model``'s GEMMs FP8, or None when it can."""
        return None

    def speed_note(self, model: nn.Module, bf16_modules: dict[str, str]) -> Optional[str]:
        """Where FP8 from this engine gains little over ``model``'s compiled BF16 or loses: why,
        and what to try (logged as a warning), or None (``bf16_modules``: the layers the policy
        keeps BF16, which :meth:`convert` leaves)."""
        return None

    def convert(self, model: nn.Module, config: dict[str, Any],
                bf16_modules: dict[str, str], fuse_mlp: Optional[bool] = False) -> list[Any]:
        """Make the model's GEMMs FP8 except ``bf16_modules``; returns hook handles to remove.
        ``fuse_mlp``: TE, a user's LayerNorm -> Linear -> GELU -> Linear as one te.LayerNormMLP
        (``None``: where found, saying nothing where none is)."""
        raise NotImplementedError

    def auto_bf16(self, gemm_modules: dict[str, nn.Module], keep: dict[str, str],
                  config: dict[str, Any], tokens: Optional[int]) -> tuple[dict[str, str], str]:
        """``fp8_layers: auto``: ``{module or module.weight name: why}`` for the GEMMs beyond
        ``keep`` that would not gain from FP8 at ``tokens`` per micro-batch (``None``: unknown),
        and how that was decided (for the log line)."""
        return {}, f"is not supported by engine {self.name}"

    def gathers_float8(self, recipe: str) -> Optional[str]:
        """Can FSDP2 gather ``recipe``'s FP8 weights as FP8 with this engine? None if so, else
        why not."""
        return f"engine {self.name} has no FP8 all-gather"

    def float8_all_gather(self, model: nn.Module, config: dict[str, Any],
                          bf16_modules: dict[str, str]) -> tuple[list[tuple[nn.Module, str]], str]:
        """Before FSDP2 shards ``model``: make the weights of the GEMMs that will run FP8 gather
        as FP8; the ``(module, weight name)`` pairs made so, and what was done or why not."""
        return [], (self.gathers_float8(config["recipe"])
                    or f"engine {self.name} does not implement its FP8 all-gather")

    def context(self, fp8: bool, amax_group: Any = None) -> Any:
        """The forward context of a step (FP8 on or off)."""
        return nullcontext()

    def set_enabled(self, model: nn.Module, on: bool) -> None:
        """Switch the converted GEMMs between FP8 and BF16 (engines without a context switch)."""

    def modules_ran(self, model: Optional[nn.Module]) -> list[str]:
        """The GEMM modules whose last forward ran FP8."""
        raise NotImplementedError

    def reset_scaling(self, model: nn.Module) -> None:
        """Forget the scaling state (before re-enabling FP8 after a fallback)."""

    def export_scaling(self, model: nn.Module) -> dict[str, dict[str, Any]]:
        """Scaling state as plain tensors, for checkpoints (stateless recipes: empty)."""
        return {}

    def import_scaling(self, model: nn.Module, scaling: dict[str, dict[str, Any]]) -> int:
        """Put exported scaling state back; returns the modules restored."""
        return 0
