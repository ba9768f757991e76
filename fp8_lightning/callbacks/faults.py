"""``FaultInjection``: a fire drill for :class:`~fp8_lightning.callbacks.guard.NaNGuard`, making
chosen steps non-finite or divergent so the guard's skip, rollback and BF16 window can be seen."""

from __future__ import annotations

import logging
from typing import Any, Literal, Optional

import lightning as L
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from ..config import ConfigError
from ..distributed import local_tensor

log = logging.getLogger(__name__)


class FaultInjection(Callback):
    """A fire drill for the guard: make chosen steps non-finite or blow them up.

    Args:
        steps: optimizer steps (0-based ``global_step`` of the batch) to hit.
        from_step: hit every step from this one on (a failure that does not go away).
        kind: ``activation`` (NaN/Inf in the token embeddings' output, so the loss and every
            gradient are non-finite), ``grad`` (one gradient element after backward) or ``lr``
            (the learning rate multiplied by ``lr_factor`` for that step: a real divergence).
        value: ``nan`` or ``inf`` for ``activation``/``grad``.
        lr_factor: learning-rate multiplier for ``kind=lr``.
        ranks: hit only these global ranks (default: every rank), e.g. ``[1]`` to check that
            one rank's bad step makes every rank skip.
    """

    def __init__(self, steps: Optional[list[int]] = None, from_step: Optional[int] = None,
                 kind: Literal["activation", "grad", "lr"] = "activation",
                 value: Literal["nan", "inf"] = "nan", lr_factor: float = 1e4,
                 ranks: Optional[list[int]] = None) -> None:
        problems = []
        if kind not in ("activation", "grad", "lr") or value not in ("nan", "inf"):
            problems.append(f"FaultInjection(kind={kind!r}, value={value!r}); valid kinds: "
                            "activation, grad, lr; values: nan, inf")
        if ranks is not None and not all(isinstance(r, int) and r >= 0 for r in ranks):
            problems.append(f"FaultInjection(ranks={ranks!r}); valid: global ranks 0, 1, ...")
        if problems:
            raise ConfigError(problems, "FaultInjection")
        self.steps, self.from_step = set(steps or []), from_step
        self.kind, self.value, self.lr_factor = kind, float(value), lr_factor
        self.ranks = None if ranks is None else set(ranks)
        self._handle: Any = None
        self._saved_lrs: Optional[list[float]] = None

    def _hit(self, trainer: L.Trainer) -> bool:
        step = trainer.global_step
        if self.ranks is not None and trainer.global_rank not in self.ranks:
            return False
        return step in self.steps or (self.from_step is not None and step >= self.from_step)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if not self._hit(trainer):
            return
        if self.kind == "activation":
            value = self.value

            def poison(_module, _args, output):
                return output * value  # NaN * x = NaN; inf * x = +/-inf (and NaN for 0)

            self._handle = pl_module.model.wte.register_forward_hook(poison)
        elif self.kind == "lr":
            optimizer = trainer.optimizers[0]
            self._saved_lrs = [g["lr"] for g in optimizer.param_groups]
            for g in optimizer.param_groups:
                g["lr"] *= self.lr_factor
        log.warning("FaultInjection: %s (%s) at step %d on rank %d", self.kind,
                    self.lr_factor if self.kind == "lr" else self.value, trainer.global_step,
                    trainer.global_rank)

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.kind == "grad" and self._hit(trainer):
            p = next(p for p in pl_module.parameters() if p.grad is not None)
            # (after DDP's all-reduce: only this rank's copy; under FSDP: this rank's shard)
            local_tensor(p.grad).view(-1)[0] = self.value  # the module's on_after_backward sees it

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._saved_lrs is not None:  # unless the scheduler has already set the next LR
            for g, lr in zip(trainer.optimizers[0].param_groups, self._saved_lrs):
                if g["lr"] == lr * self.lr_factor:
                    g["lr"] = lr
            self._saved_lrs = None
