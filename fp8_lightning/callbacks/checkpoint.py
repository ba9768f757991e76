"""``Checkpoint``: Lightning's ``ModelCheckpoint`` with atomic writes (:mod:`fp8_lightning.checkpoint_files`),
a stable directory and keep-last-K."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional

import lightning as L
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from ..checkpoint_files import (AtomicCheckpointIO, link_copy_directory, remove_stale_temporaries,
                          temporary_beside)


class Checkpoint(ModelCheckpoint):
    """``ModelCheckpoint`` with atomic writes, a stable directory and keep-last-K.

    ``last.ckpt`` is written every ``every_n_train_steps`` steps and when training ends; best-k
    checkpoints are ranked after each validation, by that validation's ``monitor``.

    Args:
        dirpath: where checkpoints go; default ``<trainer.default_root_dir>/checkpoints`` (one
            directory for every run under that root, so ``--ckpt_path last`` finds the last one).
        every_n_train_steps: write ``last.ckpt`` (and consider best-k) every N steps; ``last.ckpt``
            is also written when training ends.
        monitor: metric for best-k (``val/loss``).
        save_top_k: best-k checkpoints kept by ``monitor`` (0 = none).
        keep_last: also keep the last K periodic checkpoints as ``step-NNNNNNN.ckpt``
            (hard links to the ``last.ckpt`` of that step: no extra write); 0 = none.
        filename: name of the best-k files (metric names are not inserted: ``/`` would make
            directories).
        save_last: write ``last.ckpt``.
        **kwargs: any other ``ModelCheckpoint`` argument.
    """

    def __init__(self, dirpath: Optional[str] = None, every_n_train_steps: int = 500,
                 monitor: Optional[str] = "val/loss", save_top_k: int = 1, keep_last: int = 0,
                 filename: str = "best-step{step:07d}-val{val/loss:.4f}", save_last: bool = True,
                 auto_insert_metric_name: bool = False, **kwargs: Any) -> None:
        super().__init__(dirpath=dirpath, every_n_train_steps=every_n_train_steps,
                         monitor=monitor, save_top_k=save_top_k, filename=filename,
                         save_last=save_last, auto_insert_metric_name=auto_insert_metric_name,
                         **kwargs)
        if not isinstance(keep_last, int) or keep_last < 0:
            raise ValueError(f"Checkpoint.keep_last={keep_last!r} must be an integer >= 0")
        self.keep_last = keep_last
        self._last_ckpt_step: Optional[int] = None

    def _use_default_dir(self, trainer: L.Trainer) -> None:
        if self.dirpath is None:
            self.dirpath = os.path.realpath(os.path.join(trainer.default_root_dir, "checkpoints"))

    @override
    def _find_last_checkpoints(self, trainer: L.Trainer) -> set[str]:
        # `--ckpt_path last` is resolved before setup(): use the same default directory.
        # (Lightning's lookup takes only `last*.ckpt`: never a killed write's .last.ckpt.tmp-PID.)
        self._use_default_dir(trainer)
        return super()._find_last_checkpoints(trainer)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._use_default_dir(trainer)
        strategy = trainer.strategy
        if type(strategy.checkpoint_io) is TorchCheckpointIO:  # the default: make writes atomic
            strategy.checkpoint_io = AtomicCheckpointIO()
        super().setup(trainer, pl_module, stage)
        if trainer.is_global_zero:  # a SIGKILL mid-write leaves its temporary behind
            remove_stale_temporaries(self.dirpath)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        # Every N steps: last.ckpt (and keep-last-K) only. Best-k waits for the validation that
        # measures *these* weights (ModelCheckpoint would rank them by the previous validation).
        every = self._every_n_train_steps
        if every and trainer.global_step % every == 0 and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.fast_dev_run or trainer.state.fn != "fit":
            return
        if self.save_top_k and self.monitor:
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # ModelCheckpoint writes last.ckpt at the end only if it never wrote one; we want the end
        # state whenever it is newer than the last write.
        if self.save_last and self._last_ckpt_step != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:
        # SIGTERM (a scheduler's time limit, preemption; the CLI's first Ctrl-C too) stops
        # between steps: Lightning raises SIGTERMException once a step has ended. Write that step
        # as last.ckpt so `--ckpt_path last` resumes exactly there. Any other exception may have
        # hit mid-step: ModelCheckpoint's rule (save_on_exception) applies.
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if not isinstance(exception, SIGTERMException):
            return super().on_exception(trainer, pl_module, exception)
        if (self.save_last and trainer.state.fn == "fit" and not trainer.sanity_checking
                and not trainer.fast_dev_run and self._last_ckpt_step != trainer.global_step):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    @override
    def _save_last_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        self._last_ckpt_step = trainer.global_step
        if self.keep_last and trainer.is_global_zero and self.last_model_path:
            self._keep(Path(self.last_model_path), trainer.global_step)

    def _keep(self, last: Path, step: int) -> None:
        target = last.with_name(f"step-{step:07d}.ckpt")
        if last.is_dir() and not target.exists():  # a sharded checkpoint: a directory of links
            link_copy_directory(last, target)
        elif not target.exists():
            tmp = temporary_beside(target)
            try:
                os.link(last, tmp)  # a new inode replaces last.ckpt next time: the link keeps this one
            except OSError:
                shutil.copy2(last, tmp)
            os.replace(tmp, target)
        kept = sorted(last.parent.glob("step-*.ckpt"))
        for old in kept[: max(0, len(kept) - self.keep_last)]:
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
