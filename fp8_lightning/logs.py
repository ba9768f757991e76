"""What every logger gets: the logged tags, scalars through all of the Trainer's loggers, text
through each logger's own text API (else ``<log_dir>/text.jsonl``, said once), and the console.

Written by :class:`~fp8_lightning.callbacks.monitor.TrainingMonitor`, the NaN guard and
``FP8Stats``; read back by ``compare``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Optional

import lightning as L
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.utilities import rank_zero_warn

# Logged tags: written by the LightningModule ...
TRAIN_LOSS = "train/loss"  # the last micro-batch of the logged step
VAL_LOSS = "val/loss"
VAL_PPL = "val/ppl"
# ... and by TrainingMonitor. `compare` reads these names.
TRAIN_LOSS_MEAN = "train/loss_mean"  # the console line's loss (mean since the previous line)
LR = "lr"
GRAD_NORM = "grad_norm"
TOKENS_SEEN = "tokens_seen"
TOKENS_PER_SEC = "throughput/tok_s"
STEP_TIME_MS = "throughput/step_ms"
# 1: the line's window held a validation or a checkpoint save (its tok/s dips), else 0
PAUSED = "throughput/paused"
MFU = "throughput/mfu_pct"  # percent of the dense BF16 peak
MFU_FP8 = "throughput/mfu_fp8_pct"  # percent of the dense FP8 peak, while FP8 runs
PEAK_MEMORY = "gpu/peak_mem_gib"  # torch.cuda.max_memory_allocated, GiB
VAL_PEAK_MEMORY = "gpu/val_peak_mem_gib"  # the same during the last validation alone, GiB
FP8_ACTIVE = "fp8/active"  # 1 while FP8 runs, else 0
FALLBACK_EVENTS = "fp8/fallback_events"  # FP8 unavailable/disabled events so far
HP_METRIC = "hp_metric"  # the last val/loss, shown with the hyperparameters
# Text tags
SAMPLES = "samples"
PRECISION_TEXT = "run/precision"
SETUP_TEXT = "run/setup"
CONFIG_TEXT = "run/config"  # the model config and the FP8 recipe, as a table
FP8_EVENTS_TEXT = "fp8/events"
FALLBACK_KINDS = ("unavailable", "disabled")


def logger_step(trainer: "L.Trainer") -> int:
    """The step Lightning's own ``self.log`` uses (so our scalars line up with ``train/loss``)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    return int(getattr(loop, "_batches_that_stepped", trainer.global_step))


def log_metrics(trainer: "L.Trainer", metrics: dict[str, float]) -> None:
    """Scalars to every logger of the Trainer (rank zero, like ``self.log``), on its step axis."""
    if not trainer.is_global_zero:
        return
    step = logger_step(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
TEXT_FILE = "text.jsonl"  # text of loggers without text support, in their log_dir
_TEXT_WARNED: set[tuple[str, str]] = set()  # (logger class, where): warned once per process


def log_text(trainer: "L.Trainer", tag: str, text: str, step: Optional[int] = None) -> None:
    """A text entry (samples, events, the config table) to every logger of the Trainer.

    Each logger's own text API: TensorBoard ``add_text``, W&B ``log_text`` (a table), MLflow
    ``log_text`` (an artifact ``text/<tag>/step_N.md``), Comet ``log_text``. A logger without one
    (CSV, custom loggers) gets the entry as a JSON line in ``<log_dir>/text.jsonl``, which
    ``compare`` reads too, with one warning saying so; where it has no ``log_dir`` the warning says
    the text is not logged. Rank zero only.
    """
    if not trainer.is_global_zero:
        return
    step = logger_step(trainer) if step is None else step
    what = "text entries (samples, fp8/events, guard/events, run/config)"
    for logger in trainer.loggers:
        name = type(logger).__name__
        try:
            if _native_text(logger, tag, text, step):
                continue
            log_dir = getattr(logger, "log_dir", None)
            if not isinstance(log_dir, (str, os.PathLike)):
                _warn_once(logger, "", f"{name} has no text support and no log_dir: {what} are not "
                                       "logged (add a TensorBoardLogger or CSVLogger to keep them)")
                continue
            # The logger makes its directory first (CSVLogger clears a non-empty new one).
            getattr(logger, "experiment", None)
            # Written here because CSVLogger (and Logger) has no text API: one JSON line per entry.
            path = os.path.join(os.fspath(log_dir), TEXT_FILE)
            fs = get_filesystem(path)
            fs.makedirs(os.path.dirname(path), exist_ok=True)
            with fs.open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, "tag": tag, "text": text}, ensure_ascii=False) + "\n")
        except Exception as err:  # logging text must never stop training
            _warn_once(logger, "error", f"{name}: logging text {tag!r} failed ({type(err).__name__}: "
                                        f"{err}); {what} are not logged there")
            continue
        _warn_once(logger, path, f"{name} has no text support: {what} go to {path}")


def _native_text(logger: Any, tag: str, text: str, step: int) -> bool:
    """Log through the logger's own text API; False where it has none."""
    from lightning.pytorch import loggers

    if isinstance(logger, loggers.TensorBoardLogger):
        logger.experiment.add_text(tag, text, global_step=step)
    elif isinstance(logger, loggers.WandbLogger):
        logger.log_text(key=tag, columns=["step", "text"], data=[[step, text]], step=step)
    elif isinstance(logger, loggers.MLFlowLogger):
        logger.experiment.log_text(logger.run_id, text, f"text/{tag}/step_{step:08d}.md")
    elif isinstance(logger, loggers.CometLogger):
        logger.experiment.log_text(text, step=step, metadata={"tag": tag})
    else:
        return False
    return True


def _warn_once(logger: Any, where: str, message: str) -> None:
    key = (type(logger).__name__, where)
    if key not in _TEXT_WARNED:
        _TEXT_WARNED.add(key)
        rank_zero_warn(message)


def console_print(trainer: "L.Trainer", line: str) -> None:
    """Print without breaking Lightning's progress bar (rank zero only)."""
    if not trainer.is_global_zero:
        return
    from lightning.pytorch.callbacks.progress import TQDMProgressBar

    bar = trainer.progress_bar_callback
    if bar is None or isinstance(bar, TQDMProgressBar):
        from tqdm import tqdm

        tqdm.write(line, file=sys.stdout)
    else:
        bar.print(line)
    sys.stdout.flush()


def short_tag(tag: str) -> str:
    """A precision tag for a log line: ``BF16 (fallback: <reason>)`` -> ``BF16 (fallback)``."""
    return tag.split(" (fallback")[0] + " (fallback)" if "(fallback" in tag else tag
