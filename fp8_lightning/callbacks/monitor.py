"""``TrainingMonitor``: the console line, logged scalars, throughput/MFU and text samples.

One line per logged step (rank zero)::

    step 250 | loss 3.4568 | lr 6.00e-04 | norm 0.823 | dt 49.0ms | tok/s 334,567 | mfu 41.2% | mfu_fp8 20.6% | FP8 delayed

* ``loss``: mean training loss over the steps since the previous line; ``norm``: total gradient
  norm before clipping, of the last step; ``lr``: the first parameter group's learning rate.
* ``dt``: wall-clock time per optimizer step since the previous line, validation (and the text
  samples) excluded, checkpointing included (``throughput/paused`` is 1 for a window that held a
  validation or a checkpoint save, so ``compare`` can leave it out). The monitor never drains the
  GPU: at a logged step it copies the loss and norm to pinned memory behind a CUDA event and
  prints the line one step later, after waiting for that event only (the next step is queued);
  on a GPU ``dt`` is timed between such events, on the GPU's own clock.
* ``tok/s``: training tokens per second over all ranks; ``mfu``: model FLOPs utilisation per GPU
  against the dense BF16 peak of the GPU (see :mod:`fp8_lightning.flops` for the FLOP count and
  the peak table); ``mfu_fp8`` (only while FP8 runs) the same against the dense FP8 peak.
  ``mfu n/a`` where the peak is unknown (CPU, unlisted GPU).
* The last field is the precision that really ran: ``FP8 delayed`` or ``BF16 (fallback)`` (the
  reason is logged once, on the ``precision:`` line or with the switch event).
* GPU memory: ``gpu/peak_mem_gib`` is the peak allocated in training so far (validation left
  out), ``gpu/val_peak_mem_gib`` the peak of the last validation alone (the reference FP8 8B run
  crashed there from a memory surge); the validation line shows both, and the run ends with
  ``memory: peak X GiB in training, Y GiB in validation (this GPU)``.

Every logger of the Trainer (TensorBoard, CSV, W&B, MLflow, ...) gets the scalars: the tags
below (``train/loss_mean`` is the console line's loss), plus ``train/loss``, ``val/loss``,
``val/ppl`` that the LightningModule logs and ``hp_metric`` = the last ``val/loss``. Text (FP8
switch events, guard events, the config table, a sample generated from ``sample_prompt`` at every
validation, BF16 outside ``te.autocast``) goes through :func:`log_text`: each logger's own text
API, else ``<log_dir>/text.jsonl`` with a warning.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from ..distributed import is_sharded
from ..flops import Peak, flops_per_token, peak_for
from ..flops import mfu as mfu_of
from ..progress import Progress
from ..fp8.plugin import fp8_plugin
from ..logs import (CONFIG_TEXT, FALLBACK_EVENTS, FALLBACK_KINDS, FP8_ACTIVE, FP8_EVENTS_TEXT,
                    GRAD_NORM, HP_METRIC, LR, MFU, MFU_FP8, PAUSED, PEAK_MEMORY, PRECISION_TEXT,
                    SAMPLES, SETUP_TEXT, STEP_TIME_MS, TOKENS_PER_SEC, TOKENS_SEEN,
                    TRAIN_LOSS_MEAN, VAL_LOSS, VAL_PEAK_MEMORY, VAL_PPL, console_print, log_metrics,
                    log_text, short_tag)

log = logging.getLogger(__name__)


def format_line(step: int, loss: Optional[float], lr: Optional[float], grad_norm: Optional[float],
                step_ms: float, tokens_per_sec: float, mfu: Optional[float],
                mfu_fp8: Optional[float], precision: str) -> str:
    """The console line; ``mfu``/``mfu_fp8`` are fractions (``None``: not known / not FP8)."""

    def num(value: Optional[float], fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    parts = [f"step {step}", f"loss {num(loss, '.4f')}", f"lr {num(lr, '.2e')}",
             f"norm {num(grad_norm, '.3f')}", f"dt {step_ms:.1f}ms", f"tok/s {tokens_per_sec:,.0f}",
             f"mfu {'n/a' if mfu is None else format(100 * mfu, '.1f') + '%'}"]
    if mfu_fp8 is not None:
        parts.append(f"mfu_fp8 {100 * mfu_fp8:.1f}%")
    parts.append(precision)
    return " | ".join(parts)


def precision_tag(trainer: "L.Trainer", pl_module: "L.LightningModule") -> str:
    """``FP8 delayed`` / ``BF16 (fallback: ...)`` from the module, else the Trainer's precision."""
    tag = getattr(pl_module, "precision_tag", None)
    if callable(tag):
        try:
            return tag()
        except Exception:  # a module without a Trainer attached, say
            pass
    return str(trainer.precision)


def config_table(trainer: "L.Trainer", pl_module: "L.LightningModule") -> str:
    """A markdown table of the model config, the FP8 recipe and the module's hyperparameters."""
    rows: dict[str, Any] = {}
    config = getattr(pl_module, "config", None)
    if hasattr(config, "to_dict"):
        rows.update({f"model.config.{k}": v for k, v in config.to_dict().items()})
    plugin = fp8_plugin(trainer)
    if plugin is not None:
        rows["fp8.engine"] = plugin.engine.name
        rows.update({f"fp8.{k}": v for k, v in plugin.recipe_config.items()})
    rows.update({f"model.{k}": v for k, v in dict(pl_module.hparams).items()
                 if k != "config" and not k.startswith("_")})
    rows["trainer.precision"] = precision_tag(trainer, pl_module)
    rows["trainer.world_size"] = trainer.world_size
    return "| key | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows.items())


def fp8_active(trainer: "L.Trainer") -> bool:
    plugin = fp8_plugin(trainer)
    return plugin is not None and plugin.fp8_active


def fp8_history(trainer: "L.Trainer") -> list[dict[str, Any]]:
    """The FP8 plugin's switch events (none without the plugin)."""
    plugin = fp8_plugin(trainer)
    return plugin.history if plugin is not None else []


class TrainingMonitor(Callback):
    """The console line, logged scalars, throughput/MFU and text samples (see the module doc).

    Args:
        log_every: print and log every N optimizer steps (default: ``trainer.log_every_n_steps``).
        sample_prompt: text samples at each validation start from this prompt (``None``: off;
            ``""``: from the end-of-text token).
        sample_tokens: new tokens per sample.
        sample_temperature: sampling temperature (0: greedy).
        sample_top_k: sample from the top k tokens (``None``: all).
        sample_seed: the sample's seed (the training RNG state is saved and restored around it).
        tokenizer: decodes samples (default: the data module's ``tokenizer``, else ``gpt2``).
        console: print the console line.
    """

    def __init__(self, log_every: Optional[int] = None, sample_prompt: Optional[str] = "The",
                 sample_tokens: int = 48, sample_temperature: float = 0.8,
                 sample_top_k: Optional[int] = 50, sample_seed: int = 0,
                 tokenizer: Optional[str] = None, console: bool = True) -> None:
        super().__init__()
        if log_every is not None and log_every < 1:
            from ..config import ConfigError

            raise ConfigError([f"log_every={log_every} must be >= 1"], "TrainingMonitor")
        self.log_every = log_every
        self.sample_prompt = sample_prompt
        self.sample_tokens = sample_tokens
        self.sample_temperature = sample_temperature
        self.sample_top_k = sample_top_k
        self.sample_seed = sample_seed
        self.tokenizer = tokenizer
        self.console = console
        self.lines: list[str] = []  # the console lines printed (rank zero), for tests and tools
        self._reset()

    def _reset(self) -> None:
        self._every = 1
        self._peak: Optional[Peak] = None
        self._device_name = "cpu"
        self._flops_token: Optional[float] = None
        self._seq_len: Optional[int] = None
        self._loss_sum: Optional[torch.Tensor] = None
        self._last_step = -1  # optimizer step of the previous on_train_batch_end
        self._window: Optional[dict[str, Any]] = None  # time/event/step/tokens at the last line
        self._excluded = 0.0  # seconds of validation inside the current window
        self._paused = False  # a validation or checkpoint save inside the current window
        self._val_start: Optional[float] = None
        self._events_seen = 0
        self._pending: Optional[dict[str, Any]] = None  # a prepared line, emitted next step
        # Peak GPU memory (GiB): training's before the last reset of the CUDA peak (validations
        # reset it on entry and exit, so that each is measured alone), and validation's.
        self._train_peak = 0.0
        self._val_peak: Optional[float] = None
        self._first_step: Optional[Progress] = None  # lines while the first step compiles
        self._first_batch = False  # this fit's first training batch is still to come

    # ------------------------------------------------------------------------- helpers
    def _peak_memory(self, pl_module: "L.LightningModule") -> float:
        """The CUDA peak allocated since its last reset, GiB."""
        return torch.cuda.max_memory_allocated(pl_module.device) / 2**30

    def _sync(self, pl_module: "L.LightningModule") -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    @staticmethod
    def _tokens(pl_module: "L.LightningModule") -> int:
        return int(getattr(pl_module, "tokens_seen", 0))  # GPTLightningModule counts all ranks

    @staticmethod
    def _mark(pl_module: "L.LightningModule") -> Optional[torch.cuda.Event]:
        """A timing event at this point of the GPU's stream (None on a CPU)."""
        if pl_module.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _open_window(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self._sync(pl_module)
        self._window = {"time": time.perf_counter(), "event": self._mark(pl_module),
                        "step": trainer.global_step, "tokens": self._tokens(pl_module)}
        self._excluded = 0.0
        self._paused = False
        if self._loss_sum is not None:
            self._loss_sum.zero_()

    # ------------------------------------------------------------------------- setup
    @override
    def on_fit_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self._reset()
        self._every = self.log_every or trainer.log_every_n_steps or 50
        device = pl_module.device
        if device.type == "cuda":
            self._device_name = torch.cuda.get_device_name(device)
            self._peak = peak_for(self._device_name)
        config = getattr(pl_module, "config", None)
        datamodule = getattr(trainer, "datamodule", None)
        self._seq_len = getattr(datamodule, "seq_len", None)
        if config is not None and hasattr(config, "n_layer"):
            self._flops_token = flops_per_token(config, self._seq_len)

    @override
    def on_train_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        if self._peak is not None:
            fp8 = "n/a" if self._peak.fp8 is None else f"{self._peak.fp8 / 1e12:,.0f}"
            peak = (f"{self._device_name} = {self._peak.name}: dense peak BF16 "
                    f"{self._peak.bf16 / 1e12:,.0f} TFLOP/s, FP8 {fp8} TFLOP/s")
        elif pl_module.device.type == "cuda":
            peak = f"{self._device_name}: no peak in the table, MFU n/a"
        else:
            peak = "CPU: no peak, MFU n/a"
        flops = ("unknown (no GPTConfig)" if self._flops_token is None else
                 f"{self._flops_token / 1e6:,.1f} MFLOP/token (6 x matmul params + attention)")
        setup = f"monitor: every {self._every} steps; {peak}; {flops}"
        if self.console:
            console_print(trainer, setup)
        log_text(trainer, SETUP_TEXT, setup)
        log_text(trainer, PRECISION_TEXT, precision_tag(trainer, pl_module))
        log_text(trainer, CONFIG_TEXT, config_table(trainer, pl_module))
        self._log_events(trainer)
        self._last_step = trainer.global_step
        self._first_batch = True
        self._open_window(trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule",
                             batch: Any, batch_idx: int) -> None:
        # A compiled run's first step compiles (minutes for a large model, or on a small CPU):
        # a line every few seconds says it is working, not stuck.
        first, self._first_batch = self._first_batch, False
        if first and self.console and getattr(pl_module, "compiled", None):
            self._first_step = Progress("first training step: compiling",
                                        say=lambda line: console_print(trainer, line))
            self._first_step.__enter__()

    def _first_step_done(self) -> None:
        if self._first_step is not None:
            self._first_step.__exit__(None, None, None)
            self._first_step = None

    @override
    def on_exception(self, trainer: "L.Trainer", pl_module: "L.LightningModule",
                     exception: BaseException) -> None:
        self._first_step_done()

    def _log_events(self, trainer: "L.Trainer") -> None:
        history = fp8_history(trainer)
        new = history[self._events_seen:]
        self._events_seen = len(history)
        for event in new:
            step = event.get("step")
            log_text(trainer, FP8_EVENTS_TEXT,
                     f"**{event.get('event')}**{'' if step is None else f' at step {step}'}: "
                     f"{event.get('reason')} (now {event.get('precision')})")

    def fallback_count(self, trainer: "L.Trainer") -> int:
        history = fp8_history(trainer)
        return sum(1 for e in history if e.get("event") in FALLBACK_KINDS)

    # ------------------------------------------------------------------------- training
    @override
    def on_train_batch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule",
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self._first_step_done()
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            # On the device, no sync: the mean is read once per line. Lightning divides the loss
            # by accumulate_grad_batches, so the micro-batches of one step add up to its mean.
            loss = loss.detach().float()
            if self._loss_sum is None:
                self._loss_sum = torch.zeros((), device=loss.device)
            self._loss_sum.add_(loss)
        if isinstance(batch, torch.Tensor) and batch.ndim == 2:
            if self._seq_len is None:
                self._seq_len = batch.shape[1] - 1
                config = getattr(pl_module, "config", None)
                if config is not None and hasattr(config, "n_layer"):
                    self._flops_token = flops_per_token(config, self._seq_len)
        step = trainer.global_step
        if step == self._last_step:  # accumulating: no optimizer step yet
            return
        self._last_step = step
        if self._pending is not None:
            self._emit(trainer, pl_module)
        if step % self._every == 0 and step > self._window["step"]:
            self._prepare(trainer, pl_module, step)
            if pl_module.device.type != "cuda":
                self._emit(trainer, pl_module)

    def _prepare(self, trainer: "L.Trainer", pl_module: "L.LightningModule", step: int) -> None:
        """Snapshot step ``step``'s values without waiting for the GPU.

        The loss sum and grad norm are copied to pinned host memory behind a CUDA event; the line
        is emitted at the next step, after waiting for that event only: the GPU then still has
        the next step queued, so the pipeline is never drained (a full synchronize every line
        would).
        """
        cuda = pl_module.device.type == "cuda"
        values = {}
        for name, tensor in (("loss", self._loss_sum), ("norm", getattr(pl_module, "grad_norm", None))):
            if isinstance(tensor, torch.Tensor):
                host = torch.empty((), dtype=torch.float32, pin_memory=cuda)
                host.copy_(tensor.detach().float(), non_blocking=cuda)
                values[name] = host
        event = self._mark(pl_module)
        if self._loss_sum is not None:
            self._loss_sum.zero_()  # ordered after the copy on the stream
        self._pending = {"step": step, "event": event, "values": values,
                         "tokens": self._tokens(pl_module),
                         "lr": trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else None,
                         "active": fp8_active(trainer),
                         "tag": short_tag(precision_tag(trainer, pl_module))}

    def _emit(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        """Print and log the prepared line (waits for the GPU up to its step, not beyond)."""
        pending, self._pending = self._pending, None
        if pending["event"] is not None:
            pending["event"].synchronize()
        now = time.perf_counter()
        window = self._window
        step = pending["step"]
        steps = step - window["step"]
        # On a GPU the window runs from the step that closed the last line to this one on the
        # GPU's own clock (bubbles where it waited for the host included). Host time would start
        # the window when the last line was printed, one step late: the run's final line,
        # printed without that lag, showed one step too few (an impossible MFU at
        # log_every_n_steps 1).
        if pending["event"] is not None and window["event"] is not None:
            elapsed = window["event"].elapsed_time(pending["event"]) / 1000.0
        else:
            elapsed = now - window["time"]
        elapsed = max(elapsed - self._excluded, 1e-9)
        tokens_per_sec = (pending["tokens"] - window["tokens"]) / elapsed
        step_ms = 1000.0 * elapsed / steps
        values = pending["values"]
        loss = float(values["loss"]) / steps if "loss" in values else None
        norm = float(values["norm"]) if "norm" in values else None
        lr, active, tag = pending["lr"], pending["active"], pending["tag"]
        mfu = mfu_fp8 = None
        if self._flops_token is not None and self._peak is not None:
            per_gpu = tokens_per_sec / max(1, trainer.world_size)
            mfu = mfu_of(per_gpu, self._flops_token, self._peak.bf16)
            if active:
                mfu_fp8 = mfu_of(per_gpu, self._flops_token, self._peak.fp8)
        metrics = {TOKENS_SEEN: float(pending["tokens"]), TOKENS_PER_SEC: tokens_per_sec,
                   STEP_TIME_MS: step_ms, PAUSED: float(self._paused), FP8_ACTIVE: float(active),
                   FALLBACK_EVENTS: float(self.fallback_count(trainer))}
        if loss is not None:
            metrics[TRAIN_LOSS_MEAN] = loss
        if lr is not None:
            metrics[LR] = float(lr)
        if norm is not None:
            metrics[GRAD_NORM] = norm
        if mfu is not None:
            metrics[MFU] = 100.0 * mfu
        if mfu_fp8 is not None:
            metrics[MFU_FP8] = 100.0 * mfu_fp8
        if pl_module.device.type == "cuda":
            metrics[PEAK_MEMORY] = max(self._train_peak, self._peak_memory(pl_module))
        log_metrics(trainer, metrics)
        self._log_events(trainer)
        line = format_line(step, loss, lr, norm, step_ms, tokens_per_sec, mfu, mfu_fp8, tag)
        if trainer.is_global_zero:
            self.lines.append(line)
            if self.console:
                console_print(trainer, line)
        self._window = {"time": now, "event": pending["event"], "step": step,
                        "tokens": pending["tokens"]}
        self._excluded = 0.0
        self._paused = False

    # ------------------------------------------------------------------------- validation
    @override
    def on_validation_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        if self._pending is not None and not trainer.sanity_checking:
            self._emit(trainer, pl_module)
        if self._window is not None and not trainer.sanity_checking:
            self._sync(pl_module)
            self._val_start = time.perf_counter()
            self._paused = True
        if pl_module.device.type == "cuda" and not trainer.sanity_checking:
            self._train_peak = max(self._train_peak, self._peak_memory(pl_module))
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    @override
    def on_save_checkpoint(self, trainer: "L.Trainer", pl_module: "L.LightningModule",
                           checkpoint: dict[str, Any]) -> None:
        if self._window is not None:
            self._paused = True  # the save's time is in this window's dt

    @override
    def on_validation_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        if trainer.sanity_checking:
            return
        val = trainer.callback_metrics.get(VAL_LOSS)
        step = trainer.global_step
        if pl_module.device.type == "cuda":  # measured before the sample, which is not evaluation
            self._val_peak = self._peak_memory(pl_module)
            log_metrics(trainer, {VAL_PEAK_MEMORY: self._val_peak})
        if val is not None:
            log_metrics(trainer, {HP_METRIC: float(val)})
            if self.console:
                ppl = trainer.callback_metrics.get(VAL_PPL)
                extra = "" if ppl is None else f" | val/ppl {float(ppl):.2f}"
                if self._val_peak is not None:
                    extra += f" | peak mem {self._val_peak:.1f} GiB" + (
                        f" (training {self._train_peak:.1f} GiB)" if self._train_peak else "")
                console_print(trainer, f"step {step} | val/loss {float(val):.4f}{extra}")
        # Sharded parameters: every rank must run the model (same seed, same text); else rank 0.
        if self.sample_prompt is not None and (trainer.is_global_zero
                                               or is_sharded(trainer.strategy)):
            try:
                text = self.sample(trainer, pl_module)
            except Exception as err:  # a sample must never stop training
                text = None
                log.warning("text sample failed: %s: %s", type(err).__name__, err)
            if text is not None and trainer.is_global_zero:
                log_text(trainer, SAMPLES, "    " + text.replace("\n", "\n    "))
                if self.console:
                    console_print(trainer, f"sample (step {step}): {text!r}")
        if self._val_start is not None:
            self._sync(pl_module)
            self._excluded += time.perf_counter() - self._val_start
            self._val_start = None
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)  # training's peak from here

    def _tokenizer_name(self, trainer: "L.Trainer") -> str:
        if self.tokenizer:
            return self.tokenizer
        datamodule = getattr(trainer, "datamodule", None)
        return getattr(datamodule, "tokenizer", None) or "gpt2"

    def sample(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> Optional[str]:
        """Generate ``sample_tokens`` from ``sample_prompt`` with the model being trained.

        BF16 autocast on CUDA, outside ``te.autocast`` (so TE modules run BF16 and any prompt
        length works), fp32 on CPU; the global RNG state is restored afterwards.
        """
        model = getattr(pl_module, "model", None)
        if model is None or not hasattr(model, "generate"):
            return None
        from ..tokenizer import get_tokenizer

        tok = get_tokenizer(self._tokenizer_name(trainer))
        ids = tok.encode(self.sample_prompt) if self.sample_prompt else []
        ids = ids or [tok.eot_id]
        device = pl_module.device
        idx = torch.tensor([ids], dtype=torch.long, device=device)
        cuda = device.type == "cuda"
        with torch.random.fork_rng(devices=[device] if cuda else []):
            torch.manual_seed(self.sample_seed)
            autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()
            with torch.no_grad(), autocast:
                out = model.generate(idx, self.sample_tokens, temperature=self.sample_temperature,
                                     top_k=self.sample_top_k, vocab_size=tok.vocab_size)
        return tok.decode(out[0].tolist())

    @override
    def on_train_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self._first_step_done()
        if self._pending is not None:
            self._emit(trainer, pl_module)
        self._log_events(trainer)
        if pl_module.device.type == "cuda" and self.console:
            train = max(self._train_peak, self._peak_memory(pl_module))
            val = "" if self._val_peak is None else f", {self._val_peak:.1f} GiB in validation"
            console_print(trainer, f"memory: peak {train:.1f} GiB in training{val} (this GPU)")
