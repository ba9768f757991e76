"""``NaNGuard``: the NaN/Inf guard, with rollback and a BF16 window (its drill:
:class:`~fp8_lightning.callbacks.faults.FaultInjection`).

How :class:`NaNGuard` stays off the critical path: every step it computes one device-side flag,
``not isfinite(loss) or not isfinite(grad_norm)``, and hands it to the fused AdamW as
``found_inf`` (the mechanism ``torch.amp.GradScaler`` uses), so a non-finite step is skipped *on
the device*: no update, no weight decay, no step count, without the host waiting. The flags of the
last ``check_every`` steps are read by the host once per ``check_every`` steps (one small
transfer, all-reduced across ranks so every rank takes the same decision); that is when bad steps
are logged and the policy acts. Optimizers without ``found_inf`` support fall back to a
per-step check (one host sync per step) and drop the gradients themselves.

Policy, when ``max_bad_steps`` non-finite steps fall within ``window`` steps:

1. restore the last good state (model weights and optimizer state from an in-memory snapshot
   taken every ``snapshot_every`` clean steps, or from the last checkpoint); the data and the
   learning-rate schedule go on forward (the offending batches are not replayed);
2. if FP8 was active: switch the precision plugin to BF16 (``FP8Precision.disable_fp8``) for
   ``bf16_steps`` steps (0 = the rest of the run), then re-enable FP8 with fresh scaling state;
3. if training was already BF16: stop with :class:`NonFiniteTrainingError` (the problem is not
   FP8); checkpoints already written stay intact.

Every event goes to the console (rank zero), the loggers (``guard/*`` scalars, a TensorBoard
text entry) and the checkpoint (the callback's ``state_dict``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import Any, Literal, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from ..checkpoint_files import load_checkpoint_file
from ..config import ConfigError
from ..distributed import local_tensor
from ..fp8.plugin import fp8_plugin
from ..logs import log_metrics, log_text

log = logging.getLogger(__name__)


class NonFiniteTrainingError(RuntimeError):
    """Training produced non-finite values in BF16: not an FP8 problem."""


class NaNGuard(Callback):
    """Skip non-finite steps; after too many, roll back and fall back to BF16 for a while.

    Args:
        max_bad_steps: non-finite steps within ``window`` that trigger a rollback.
        window: the window, in optimizer steps.
        bf16_steps: BF16 steps after an FP8 incident before FP8 is re-enabled with fresh
            scaling state; 0 keeps BF16 for the rest of the run.
        max_fp8_incidents: after this many FP8 incidents FP8 stays off for the rest of the run.
        rollback: ``memory`` (snapshot of weights and optimizer state in pinned host memory, the
            first at the first clean check, then every ``snapshot_every`` steps; costs 3x the
            fp32 weights in host RAM: use ``checkpoint`` for large models), ``checkpoint``
            (reload the newest ``last.ckpt`` written before the incident) or ``none``.
        snapshot_every: steps between in-memory snapshots (rounded up to ``check_every``).
        check_every: steps between host reads of the flags (default: the Trainer's
            ``log_every_n_steps``, where logging already synchronises).
    """

    def __init__(self, max_bad_steps: int = 3, window: int = 100, bf16_steps: int = 1000,
                 max_fp8_incidents: int = 3,
                 rollback: Literal["memory", "checkpoint", "none"] = "memory",
                 snapshot_every: int = 500, check_every: Optional[int] = None) -> None:
        problems = []
        for key, value, low in (("max_bad_steps", max_bad_steps, 1), ("window", window, 1),
                                ("bf16_steps", bf16_steps, 0),
                                ("max_fp8_incidents", max_fp8_incidents, 1),
                                ("snapshot_every", snapshot_every, 1)):
            if not isinstance(value, int) or value < low:
                problems.append(f"NaNGuard.{key}={value!r} must be an integer >= {low}")
        if check_every is not None and (not isinstance(check_every, int) or check_every < 1):
            problems.append(f"NaNGuard.check_every={check_every!r} must be an integer >= 1")
        if rollback not in ("memory", "checkpoint", "none"):
            problems.append(f"NaNGuard.rollback={rollback!r}; valid: memory, checkpoint, none")
        if problems:
            raise ConfigError(problems, "NaNGuard")
        self.max_bad_steps, self.window, self.bf16_steps = max_bad_steps, window, bf16_steps
        self.max_fp8_incidents, self.rollback = max_fp8_incidents, rollback
        self.snapshot_every, self.check_every = snapshot_every, check_every
        # Restart state (saved in checkpoints).
        self.events: list[dict[str, Any]] = []
        self.skipped_steps = 0
        self.fp8_incidents = 0
        self.bf16_until: Optional[int] = None  # step at which FP8 comes back; -1 = never
        # Per-run state.
        self._bad_recent: deque[int] = deque()
        self._loss: Optional[torch.Tensor] = None
        self._flags: Optional[torch.Tensor] = None  # (check_every,) bad flags, on the device
        self._pending: list[int] = []  # steps whose flags are in _flags, not yet read
        self._device_skip = True
        self._snapshot: Optional[dict[str, Any]] = None
        self._snapshot_step: Optional[int] = None
        self.snapshot_ms: Optional[float] = None  # wall time of the last snapshot

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.check_every is None:
            self.check_every = max(1, int(trainer.log_every_n_steps))

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        optimizers = trainer.optimizers
        self._device_skip = all(o.defaults.get("fused") for o in optimizers)
        if not self._device_skip:
            rank_zero_only(log.info)("NaNGuard: the optimizer has no device-side skip "
                                     "(found_inf); checking every step on the host instead "
                                     "(one sync per step)")
        device = pl_module.device
        self._flags = torch.zeros(self.check_every, dtype=torch.bool, device=device)
        self._pending = []
        self._bad_recent.clear()

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           loss: torch.Tensor) -> None:
        self._loss = loss.detach()

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self._flag(trainer, pl_module, optimizer, self._loss, getattr(pl_module, "grad_norm", None))

    def _flag(self, trainer: L.Trainer, pl_module: L.LightningModule,
              optimizer: torch.optim.Optimizer, loss: Optional[torch.Tensor],
              norm: Optional[torch.Tensor]) -> None:
        """This step's bad flag (non-finite ``loss`` or gradient ``norm``), on the device."""
        step = trainer.global_step
        bad = ~torch.isfinite(loss) if loss is not None else None
        if norm is not None:
            norm_bad = ~torch.isfinite(norm)
            bad = norm_bad if bad is None else bad | norm_bad
        if bad is None:
            return
        if trainer.world_size > 1:
            # One rank's non-finite loss makes every rank skip: one all-reduce enqueued on the
            # device, so the replicas never diverge and the host does not wait. (Not
            # strategy.reduce: Lightning's _sync_ddp puts a barrier, a host sync, before it.)
            flag = bad.float()
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            bad = flag > 0
        if self._device_skip:
            optimizer.found_inf = bad.float()  # fused AdamW skips the whole update on the device
            slot = len(self._pending)
            self._flags[slot] = bad
            self._pending.append(step)
        else:
            is_bad = bool(bad)  # host sync: this optimizer cannot skip on the device
            if is_bad:
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        p.grad = None  # the optimizer skips parameters without gradients
            self._flags[0] = bad
            self._pending = [step]
            self._check(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        step = trainer.global_step  # steps completed
        if len(self._pending) >= self.check_every:  # the rest is read in on_train_end
            self._check(trainer, pl_module)
        if self.bf16_until is not None and 0 <= self.bf16_until <= step:
            plugin = self._fp8_plugin(trainer)
            self.bf16_until = None
            if plugin is not None and plugin.enable_fp8(reset_scaling=True, step=step):
                self._event(trainer, "fp8_reenabled", step,
                            "FP8 re-enabled with fresh scaling state after the BF16 window")

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._pending:
            self._check(trainer, pl_module)

    # ------------------------------------------------------------------ the policy
    def _check(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Read the pending flags (one transfer), log bad steps, act on an incident."""
        flags = self._flags[: len(self._pending)].int()  # already the same on every rank
        bad_steps = [s for s, f in zip(self._pending, flags.tolist()) if f]
        self._pending = []
        self._flags.zero_()
        last = trainer.global_step
        for step in bad_steps:
            self.skipped_steps += 1
            self._bad_recent.append(step)
            self._event(trainer, "skipped", step, "non-finite loss or gradient: optimizer step "
                        "skipped, gradients dropped")
        while self._bad_recent and self._bad_recent[0] <= last - self.window:
            self._bad_recent.popleft()
        if len(self._bad_recent) >= self.max_bad_steps:
            steps = list(self._bad_recent)
            self._bad_recent.clear()
            self._incident(trainer, pl_module, steps)
        elif not bad_steps and self.rollback == "memory" and (
                self._snapshot_step is None or last - self._snapshot_step >= self.snapshot_every):
            self._take_snapshot(trainer, pl_module)

    def _incident(self, trainer: L.Trainer, pl_module: L.LightningModule, steps: list[int]) -> None:
        step = trainer.global_step
        what = f"{len(steps)} non-finite steps within {self.window} steps (steps {steps})"
        plugin = self._fp8_plugin(trainer)
        if plugin is None or not plugin.fp8_active:
            precision = "BF16" if plugin is not None else str(trainer.precision)
            self._event(trainer, "error", step, f"{what} in {precision}")
            raise NonFiniteTrainingError(
                f"training is non-finite in {precision} ({what}), so the problem is not FP8: "
                "lower model.learning_rate, check gradient_clip_val and the data. The checkpoints "
                "already written are intact (resume with --ckpt_path last after fixing the cause).")
        restored = self._restore(trainer, pl_module, before=steps[0])
        self.fp8_incidents += 1
        if self.bf16_steps == 0 or self.fp8_incidents >= self.max_fp8_incidents:
            self.bf16_until = -1
            window = "for the rest of the run"
        else:
            self.bf16_until = step + self.bf16_steps
            window = f"until step {self.bf16_until}"
        self._event(trainer, "rollback", step, f"{what}; restored {restored}")
        plugin.disable_fp8(f"NaN guard: {what}", step=step)
        self._event(trainer, "bf16_fallback", step, f"BF16 {window}")

    def _restore(self, trainer: L.Trainer, pl_module: L.LightningModule, before: int) -> str:
        if self.rollback == "memory" and self._snapshot is not None \
                and self._snapshot_step is not None and self._snapshot_step <= before:
            self._load_snapshot(trainer, pl_module)
            return f"the in-memory snapshot of step {self._snapshot_step}"
        if self.rollback == "checkpoint":
            path = _last_checkpoint_before(trainer, before)
            if path is not None:
                # Sharded strategies load weights and optimizer state in place (every rank);
                # otherwise the whole checkpoint comes back and is loaded here.
                ckpt = trainer.strategy.load_checkpoint(path)
                if "state_dict" in ckpt:
                    pl_module.load_state_dict(ckpt["state_dict"], strict=False)
                    for optimizer, state in zip(trainer.optimizers, ckpt["optimizer_states"]):
                        optimizer.load_state_dict(state)
                return f"weights and optimizer state of {path} (step {ckpt['global_step']})"
        return "nothing (no good state older than the first bad step; weights are finite " \
               "because bad steps were skipped)"

    # ------------------------------------------------------------------ snapshots
    def _tensors(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[torch.Tensor]:
        """Weights and optimizer state, in a fixed order (restored in place)."""
        tensors = [p.data for p in pl_module.parameters()]
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    tensors.extend(v for v in optimizer.state.get(p, {}).values()
                                   if isinstance(v, torch.Tensor))
        return [local_tensor(t) for t in tensors]  # under FSDP: this rank's shards

    @torch.no_grad()
    def _take_snapshot(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Copy weights and optimizer state into host buffers (pinned, allocated once)."""
        start = time.perf_counter()
        tensors = self._tensors(trainer, pl_module)
        snap = self._snapshot
        if snap is None or len(snap["host"]) != len(tensors) or any(
                h.shape != t.shape or h.dtype != t.dtype for h, t in zip(snap["host"], tensors)):
            pin = torch.cuda.is_available() and any(t.is_cuda for t in tensors)
            snap = {"host": [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors]}
        for host, t in zip(snap["host"], tensors):
            host.copy_(t, non_blocking=True)
        if any(t.is_cuda for t in tensors):
            torch.cuda.current_stream().synchronize()
        self._snapshot, self._snapshot_step = snap, trainer.global_step
        self.snapshot_ms = (time.perf_counter() - start) * 1e3

    @torch.no_grad()
    def _load_snapshot(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        tensors = self._tensors(trainer, pl_module)
        host = self._snapshot["host"]
        if len(host) != len(tensors):  # optimizer state appeared after the snapshot
            params = [local_tensor(p.data) for p in pl_module.parameters()]
            for t, h in zip(params, host):
                t.copy_(h)
            for optimizer in trainer.optimizers:
                optimizer.state.clear()
            return
        for t, h in zip(tensors, host):
            t.copy_(h, non_blocking=True)

    # ------------------------------------------------------------------ events and state
    @staticmethod
    def _fp8_plugin(trainer: L.Trainer) -> Any:
        return fp8_plugin(trainer)

    def _event(self, trainer: L.Trainer, kind: str, step: int, detail: str) -> None:
        event = {"event": kind, "step": int(step), "detail": detail}
        self.events.append(event)
        rank_zero_only(log.info if kind == "fp8_reenabled" else log.warning)(
            f"NaN guard: {kind} at step {step}: {detail}")
        plugin = self._fp8_plugin(trainer)
        metrics = {"guard/skipped_steps": float(self.skipped_steps),
                   "guard/fp8_incidents": float(self.fp8_incidents)}
        if plugin is not None:
            metrics["guard/fp8_active"] = float(plugin.fp8_active)
        log_metrics(trainer, metrics)
        log_text(trainer, "guard/events", f"step {step}: **{kind}** {detail}")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"events": [dict(e) for e in self.events], "skipped_steps": self.skipped_steps,
                "fp8_incidents": self.fp8_incidents, "bf16_until": self.bf16_until}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.events = list(state_dict.get("events", []))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.fp8_incidents = int(state_dict.get("fp8_incidents", 0))
        self.bf16_until = state_dict.get("bf16_until")


def _last_checkpoint_before(trainer: L.Trainer, step: int) -> Optional[str]:
    """The newest ``last.ckpt`` of the run's checkpoint callbacks written before ``step``."""
    for callback in trainer.checkpoint_callbacks:
        path = getattr(callback, "last_model_path", "") or ""
        if path and load_checkpoint_file(path, mmap=True).get("global_step", math.inf) <= step:
            return path
    return None
