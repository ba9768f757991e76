"""Checkpoints that survive a kill, say what they hold, and refuse to load the wrong thing.

* :class:`AtomicCheckpointIO` writes ``NAME.tmp-PID`` in the target directory, fsyncs it and
  ``os.replace``-s it over ``NAME``: a kill at any moment leaves either the old file or the new
  one, never a torn one. (Lightning's default ``_atomic_save`` goes through an fsspec transaction
  whose temporary file lives in ``/tmp`` and is *copied* over the target when ``/tmp`` is another
  filesystem, which is not atomic.) Loading turns missing, truncated and foreign files into one
  :class:`CheckpointError` naming the path.
* :class:`Checkpoint` is Lightning's ``ModelCheckpoint`` with the project's defaults: one stable
  directory per run root (so ``--ckpt_path last`` finds it across runs), ``last.ckpt`` every N steps
  and at the end, best-k by ``val/loss``, and optionally the last K periodic checkpoints.
* :func:`list_checkpoints` backs ``python -m fp8_lightning checkpoints DIR``.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, foreign or does not match this run."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not supported on this platform / filesystem
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary file beside ``path``, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2``); False where that is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def publish_directory(tmp: Path, path: Path) -> None:
    """Put directory ``tmp`` at ``path``, replacing what is there, atomically where possible."""
    for f in tmp.rglob("*"):  # (Lightning's meta.pt is not fsynced by its writer)
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    if os.path.lexists(path):
        if _exchange(tmp, path):
            old = tmp  # after the swap, tmp holds the previous checkpoint
        else:  # two renames: in between, the previous checkpoint sits at `old` (never lost)
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()
    else:
        os.replace(tmp, path)
    _fsync_dir(path.parent)


def link_copy_directory(src: Path, dst: Path) -> None:
    """``dst`` as a copy of checkpoint directory ``src`` made of hard links (no extra write)."""
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)

    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, tmp, copy_function=link)
    publish_directory(tmp, dst)


SHARDED_META = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """A directory: what sharded strategies write (DCP shards plus Lightning's ``meta.pt``;
    :func:`load_checkpoint_file` says which part is missing from an incomplete one)."""
    return Path(path).is_dir()


def _torch_load(path: Path, what: str, map_location: Any, mmap: bool) -> Any:
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
        raise CheckpointError(f"checkpoint {what!r} holds objects other than tensors and plain "
                              f"types ({found.group(1) if found else 'a pickled object'}; not "
                              "written by fp8-lightning): refusing to unpickle it") from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile) as err:
        raise CheckpointError(f"checkpoint {what!r} is truncated or corrupt "
                              f"({str(err).splitlines()[0]}); use an older checkpoint from "
                              f"{str(Path(what).parent)!r}") from None


def load_checkpoint_file(path: str | os.PathLike, map_location: Any = "cpu",
                         mmap: bool = False) -> dict[str, Any]:
    """Load a Lightning checkpoint with ``weights_only=True``; one clear error for bad files.

    For a sharded checkpoint (a directory) this is its ``meta.pt``: everything but the weights and
    optimizer state (``state_dict`` is absent; :func:`consolidate_checkpoint` gathers them).
    """
    path = Path(path)
    if is_sharded_checkpoint(path):
        missing = [n for n in (SHARDED_META, ".metadata") if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"checkpoint {str(path)!r} is a directory without "
                                  f"{' and '.join(missing)}: not a complete sharded checkpoint; "
                                  f"use an older checkpoint from {str(path.parent)!r}")
        checkpoint = _torch_load(path / SHARDED_META, str(path), map_location, mmap)
        required: tuple[str, ...] = ("pytorch-lightning_version",)
    elif not path.is_file():
        near = sorted(p.name for p in path.parent.glob("*.ckpt")
                      if not p.name.startswith(".")) if path.parent.is_dir() else []
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist"
                                + (f"; in that directory: {', '.join(near)}" if near else ""))
    else:
        checkpoint = _torch_load(path, str(path), map_location, mmap)
        required = ("state_dict", "pytorch-lightning_version")
    if not isinstance(checkpoint, dict) or not all(k in checkpoint for k in required):
        keys = list(checkpoint)[:5] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise CheckpointError(f"checkpoint {str(path)!r} is not a Lightning checkpoint (needs "
                              f"{' and '.join(required)}; found {keys})")
    return checkpoint


def consolidate_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """A sharded checkpoint directory gathered into one ordinary Lightning checkpoint (CPU).

    Full tensors, the single-GPU parameter names, and the optimizer state in Lightning's
    ``optimizer_states`` list (its parameters keyed by name in the optimizer's own order, which
    ``Optimizer.load_state_dict`` maps by position): the result resumes or evaluates on one GPU or
    on the CPU (torch backend). A plain checkpoint file is returned as it is.
    """
    path = Path(path)
    meta = load_checkpoint_file(path, map_location=map_location)  # validates; all of a file
    if not is_sharded_checkpoint(path):
        return meta
    from lightning.fabric.utilities.load import _load_distributed_checkpoint
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        checkpoint = _load_distributed_checkpoint(path)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - many types for torn shards
        raise CheckpointError(f"checkpoint {str(path)!r}: its shards could not be read "
                              f"({type(err).__name__}: {str(err).strip().splitlines()[0][:200]})"
                              ) from None
    optimizers = sorted((k for k in checkpoint if re.fullmatch(r"optimizer_\d+", k)),
                        key=lambda k: int(k.split("_")[1]))
    checkpoint["optimizer_states"] = [checkpoint.pop(k) for k in optimizers]
    return checkpoint


def consolidate(checkpoint: str, output: Optional[str] = None) -> str:
    """Gather a sharded (FSDP) checkpoint directory into one file that loads on one GPU or the CPU.

    Args:
        checkpoint: the sharded checkpoint directory (e.g. runs/x/checkpoints/last.ckpt).
        output: the file to write; default ``consolidated-stepNNNNNNN.ckpt`` beside it (not a
            ``last*`` name: ``--ckpt_path last`` keeps meaning the newest training checkpoint).
    """
    src = Path(checkpoint)
    if not is_sharded_checkpoint(src):
        if src.is_file():
            raise CheckpointError(f"checkpoint {checkpoint!r} is already a single file")
        load_checkpoint_file(src)  # the missing-file error, with the directory's checkpoints
    if output and Path(output).is_dir():
        raise CheckpointError(f"consolidate --output {output!r} is a directory; give a file name "
                              f"such as {str(Path(output) / 'consolidated.ckpt')!r}")
    checkpoint = consolidate_checkpoint(src)
    dst = Path(output) if output else \
        src.with_name(f"consolidated-step{int(checkpoint.get('global_step', 0)):07d}.ckpt")
    atomic_torch_save(checkpoint, dst)
    size = dst.stat().st_size
    print(f"{dst} ({size / 2**20:.1f} MB): one file, loads on one GPU or the CPU")
    return str(dst)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with atomic writes and validated, ``weights_only`` loads."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        atomic_torch_save(checkpoint, path)

    @override
    def load_checkpoint(self, path: Any, map_location: Any = lambda storage, loc: storage,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        return consolidate_checkpoint(path, map_location=map_location)


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
        self._use_default_dir(trainer)
        # Never a temporary (.last.ckpt.tmp-PID) left by a kill mid-write.
        return {p for p in super()._find_last_checkpoints(trainer)
                if not os.path.basename(p).startswith(".")}

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._use_default_dir(trainer)
        strategy = trainer.strategy
        if type(strategy.checkpoint_io) is TorchCheckpointIO:  # the default: make writes atomic
            strategy.checkpoint_io = AtomicCheckpointIO()
        super().setup(trainer, pl_module, stage)

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
            tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
            try:
                os.link(last, tmp)  # a new inode replaces last.ckpt next time: the link keeps this one
            except OSError:
                import shutil

                shutil.copy2(last, tmp)
            os.replace(tmp, target)
        kept = sorted(last.parent.glob("step-*.ckpt"))
        for old in kept[: max(0, len(kept) - self.keep_last)]:
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------- listing
def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def describe_checkpoint(path: Path) -> dict[str, Any]:
    """One row for ``checkpoints``: step, tokens, val loss, precision, size (or the error)."""
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() \
        else path.stat().st_size
    row: dict[str, Any] = {"file": path.name + ("/" if path.is_dir() else ""), "size": size}
    try:
        ckpt = load_checkpoint_file(path, mmap=True)
    except (CheckpointError, FileNotFoundError) as err:
        row["error"] = str(err).split(" is ", 1)[-1] if " is " in str(err) else str(err)
        return row
    meta = ckpt.get("fp8_lightning", {})
    row.update(step=ckpt.get("global_step"), tokens=ckpt.get("tokens_seen"),
               val_loss=meta.get("val_loss"), precision=meta.get("precision", "?"),
               model=meta.get("config", {}).get("name", "?"))
    return row


def list_checkpoints(directory: str) -> list[dict[str, Any]]:
    """Rows describing every ``*.ckpt`` in ``directory``, oldest step first."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
    rows = [describe_checkpoint(p) for p in sorted(root.glob("*.ckpt")) if not p.name.startswith(".")]
    return sorted(rows, key=lambda r: (r.get("step") is None, r.get("step") or 0, r["file"]))


def format_checkpoints(rows: list[dict[str, Any]]) -> str:
    header = ("file", "step", "tokens", "val loss", "precision", "model", "size")
    lines = []
    for r in rows:
        if "error" in r:
            lines.append((r["file"], "-", "-", "-", f"UNREADABLE: {r['error']}", "-", _human(r["size"])))
            continue
        val = "-" if r["val_loss"] is None else f"{r['val_loss']:.4f}"
        tokens = "-" if r["tokens"] is None else f"{r['tokens']:,}"
        lines.append((r["file"], str(r["step"]), tokens, val, r["precision"], r["model"],
                      _human(r["size"])))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)] if lines else []
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths))] if lines else []
    out += ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)) for line in lines]
    return "\n".join(out) if out else "(no checkpoints)"


def checkpoints(directory: str) -> None:
    """List the checkpoints in DIRECTORY: step, tokens seen, validation loss, precision, size.

    Args:
        directory: a checkpoint directory (e.g. runs/quickstart/checkpoints) or a run root that
            contains one.
    """
    root = Path(directory)
    if root.is_dir() and not any(root.glob("*.ckpt")) and (root / "checkpoints").is_dir():
        root = root / "checkpoints"
    rows = list_checkpoints(str(root))
    print(f"{root}:")
    print(format_checkpoints(rows))


def checkpoint_versions() -> dict[str, str]:
    """Versions recorded in every checkpoint: torch, lightning, TransformerEngine."""
    from .te_support import te_version

    return {"torch": str(torch.__version__), "lightning": str(L.__version__),
            "transformer_engine": str(te_version())}
