"""Lightning Fabric forms of the FP8 plugin and the NaN guard.

``Fabric(plugins=[FabricFP8Precision()])`` runs the same FP8 as ``Trainer(plugins=[FP8Precision()])``
(one implementation, :class:`~fp8_lightning.fp8.FP8PrecisionBase`): the recipe, the layer policy,
the fallback to BF16 (FP32 on a CPU without BF16) with the reason in the log, the amax reduction
over every data-parallel rank and the FP8 scaling state in checkpoints. What differs is what a Fabric
loop calls: Fabric wraps each forward of a set-up module in the plugin's ``forward_context``, so
the plugin decides there whether it is a training forward (FP8) or an evaluation one (BF16 unless
``fp8_eval``), from the model's ``training`` flag.

Fabric does not checkpoint the precision plugin (``fabric.save`` writes only what is in the state
dict), so put the plugin in the state; it has ``state_dict``/``load_state_dict`` and so is saved
and restored like a module::

    state = {"model": model, "optimizer": optimizer, "fp8": fabric.strategy.precision, "step": step}
    fabric.save(path, state)
    fabric.load(path, state)  # after fabric.setup (before works too: applied at set-up)

Under FSDP2 (a directory of shards) load with :func:`load` instead: Fabric hands the plugin's
state back as a dict there rather than loading it.

:class:`FabricNaNGuard` is :class:`~fp8_lightning.callbacks.guard.NaNGuard` driven from a Fabric loop.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
from lightning.fabric import Fabric
from lightning_utilities import apply_to_collection
from torch import nn
from typing_extensions import override

from .callbacks.guard import NaNGuard
from .checkpoint_files import safe_lightning_dcp_loads
from .config import ConfigError
from .distributed import full_tensor
from .fp8 import FP8PrecisionBase


def _cast_floating(data: Any, dtype: torch.dtype) -> Any:
    return apply_to_collection(data, torch.Tensor,
                               lambda t: t.to(dtype) if torch.is_floating_point(t) else t)


class FabricFP8Precision(FP8PrecisionBase):
    """The FP8 precision plugin for ``lightning.Fabric`` (``Fabric(plugins=[FabricFP8Precision()])``).

    Arguments and behaviour: :class:`~fp8_lightning.fp8.FP8PrecisionBase` (the same as
    :class:`~fp8_lightning.fp8.FP8Precision`). A forward of the set-up model in ``train()`` mode
    runs FP8; in ``eval()`` mode BF16 unless ``fp8_eval``. As Fabric's own precisions do, floating
    outputs come back in the default dtype (FP32) and, with ``weights="bf16-true"``, floating
    inputs go in as BF16. Put the plugin (``fabric.strategy.precision``) in the state of
    ``fabric.save``/``fabric.load`` to checkpoint its FP8 scaling state and switch history.
    """

    @override
    def forward_context(self) -> Any:
        model = self.model
        if model is None or model.training:
            # each forward, not each step: one may still await its backward
            return self._training_context(step_start=False)
        return self._context(fp8=self.fp8_eval)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, **kwargs)
        if self.converter is not None:  # Fabric's forwards do not say when a step starts
            self.converter.step_end()
        return out

    @override
    def convert_input(self, data: Any) -> Any:
        return _cast_floating(data, torch.bfloat16) if self.precision == "bf16-true" else data

    @override
    def convert_output(self, data: Any) -> Any:
        return _cast_floating(data, torch.get_default_dtype())


class _FabricLoop:
    """The part of a Trainer that :class:`NaNGuard` reads, answered by a Fabric loop (the guard's
    hooks take a Trainer; this lets :class:`FabricNaNGuard` reuse them unchanged)."""

    checkpoint_callbacks: list[Any] = []  # rollback from a checkpoint is Trainer-only

    def __init__(self, fabric: Fabric, optimizer: torch.optim.Optimizer, check_every: int) -> None:
        self.fabric = fabric
        self.optimizers = [optimizer]
        self.global_step = 0  # optimizer steps completed
        self.log_every_n_steps = check_every

    @property
    def world_size(self) -> int:
        return self.fabric.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.fabric.is_global_zero

    @property
    def loggers(self) -> list[Any]:
        return self.fabric.loggers

    @property
    def precision_plugin(self) -> Any:
        return self.fabric.strategy.precision

    @property
    def precision(self) -> str:
        return str(self.fabric.strategy.precision.precision)


class FabricNaNGuard(NaNGuard):
    """:class:`~fp8_lightning.callbacks.guard.NaNGuard` for a ``lightning.Fabric`` loop: the same policy
    (skip non-finite steps on the device; after ``max_bad_steps`` within ``window`` roll back to
    the in-memory snapshot and train BF16 for ``bf16_steps``; in BF16 stop with
    ``NonFiniteTrainingError``), driven by three calls::

        guard = FabricNaNGuard(fabric, model, optimizer)  # after fabric.setup
        for batch in loader:
            loss = model(x, y)
            fabric.backward(loss)
            norm = fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
            guard.before_optimizer_step(loss, norm)  # a device-side flag: fused AdamW skips a bad step
            optimizer.step()
            optimizer.zero_grad()
            guard.after_optimizer_step()  # every check_every steps: read flags, log, act
        guard.end()  # reads the last flags

    Put the guard in the state of ``fabric.save``/``fabric.load``: it saves its events, incident
    count, BF16 window and its step count (``global_step``).

    Args:
        fabric: the ``Fabric`` (its precision plugin is switched to BF16 and back; its loggers
            get the ``guard/*`` scalars).
        model: the set-up model (weights for the snapshot).
        optimizer: the set-up optimizer (``fused=True`` AdamW skips a bad step on the device;
            other optimizers are checked on the host every step).
        check_every: steps between host reads of the flags (one small transfer each).
        rollback: ``memory`` or ``none`` (``checkpoint`` needs the Trainer's checkpoint callbacks).
        The others: as :class:`~fp8_lightning.callbacks.guard.NaNGuard`.
    """

    def __init__(self, fabric: Fabric, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 max_bad_steps: int = 3, window: int = 100, bf16_steps: int = 1000,
                 max_fp8_incidents: int = 3, rollback: Literal["memory", "none"] = "memory",
                 snapshot_every: int = 500, check_every: int = 50) -> None:
        if rollback == "checkpoint":
            raise ConfigError(["FabricNaNGuard.rollback='checkpoint' needs the Trainer's "
                               "checkpoint callbacks; valid here: memory, none"], "FabricNaNGuard")
        if not isinstance(check_every, int) or check_every < 1:
            raise ConfigError([f"FabricNaNGuard.check_every={check_every!r} must be an integer "
                               ">= 1"], "FabricNaNGuard")
        super().__init__(max_bad_steps=max_bad_steps, window=window, bf16_steps=bf16_steps,
                         max_fp8_incidents=max_fp8_incidents, rollback=rollback,
                         snapshot_every=snapshot_every, check_every=check_every)
        # A _FabricOptimizer's step goes to the optimizer it wraps, which reads found_inf from
        # itself: the flag must be set there, not on the wrapper.
        self.optimizer = getattr(optimizer, "optimizer", optimizer)
        self.model = model
        self._loop = _FabricLoop(fabric, self.optimizer, check_every)
        self.on_train_start(self._loop, model)

    @property
    def global_step(self) -> int:
        """Optimizer steps this guard has seen (restored by ``fabric.load``)."""
        return self._loop.global_step

    def before_optimizer_step(self, loss: torch.Tensor,
                              grad_norm: Optional[torch.Tensor] = None) -> None:
        """Flag this step if ``loss`` or ``grad_norm`` is non-finite (after ``fabric.backward``)."""
        # Under FSDP2 fabric.clip_gradients returns the norm as a DTensor: its value, on the device
        norm = (full_tensor(grad_norm).detach().float() if isinstance(grad_norm, torch.Tensor)
                else None)
        self._flag(self._loop, self.model, self.optimizer, loss.detach(), norm)

    def after_optimizer_step(self) -> None:
        """Count the step; every ``check_every`` steps read the flags and apply the policy."""
        self._loop.global_step += 1
        self.on_train_batch_end(self._loop, self.model, None, None, 0)

    def end(self) -> None:
        """Read the flags not yet read (call once after the loop)."""
        self.on_train_end(self._loop, self.model)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "global_step": self._loop.global_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._loop.global_step = int(state_dict.get("global_step", 0))


def load(fabric: Fabric, path: Any, state: dict[str, Any]) -> None:
    """``fabric.load(path, state)`` with nothing run from the checkpoint, and every stateful
    object of ``state`` (the FP8 plugin, the guard, a scheduler) loaded, whatever the layout.

    Tensors only (``weights_only``), and a sharded checkpoint's ``.metadata`` through the
    package's allow-listing reader (DCP's own unpickles it). Fabric's ``ModelParallelStrategy``
    puts a directory checkpoint's saved state of objects other than modules and optimizers into
    ``state`` in place of the objects (``state[key] = metadata.pop(key)`` in its
    ``_load_checkpoint``; its one-file path calls their ``load_state_dict``): without this an FP8
    run resumed under FSDP2 started its scaling state afresh, and its next loss jumped
    (docs/fabric.md).
    """
    stateful = {key: obj for key, obj in state.items()
                if callable(getattr(obj, "load_state_dict", None))
                and not isinstance(obj, (nn.Module, torch.optim.Optimizer))}
    with safe_lightning_dcp_loads():
        fabric.load(path, state, weights_only=True)
    for key, obj in stateful.items():
        if state[key] is not obj:  # the saved dict, handed back instead of loaded
            obj.load_state_dict(state[key])
            state[key] = obj
