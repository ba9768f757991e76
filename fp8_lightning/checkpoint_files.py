"""Checkpoints that survive a kill, say what they hold, and refuse to load the wrong thing.

* :class:`AtomicCheckpointIO` writes ``NAME.tmp-PID`` in the target directory, fsyncs it and
  ``os.replace``-s it over ``NAME``: a kill at any moment leaves either the old file or the new
  one, never a torn one. (Lightning's default ``_atomic_save`` goes through an fsspec transaction
  whose temporary file lives in ``/tmp`` and is *copied* over the target when ``/tmp`` is another
  filesystem, which is not atomic.) Loading turns missing, truncated and foreign files into one
  :class:`CheckpointError` naming the path.
* No code runs from a checkpoint: every file is unpickled by an allow-listing unpickler. Lightning
  files (``*.ckpt``, a sharded directory's ``meta.pt``) by ``torch.load(weights_only=True)``; a
  sharded directory's ``.metadata`` (which torch's DCP reader unpickles with plain ``pickle``) by
  :class:`MetadataUnpickler`, and its shards by :class:`SafeFileSystemReader` and
  :class:`SafeLoadPlanner` (DCP's default planner unpickles non-tensor entries with
  ``weights_only=False``).
* :func:`describe_checkpoint` / :func:`list_checkpoints` say what a checkpoint holds (for
  ``python -m fp8_lightning checkpoints DIR``, :mod:`fp8_lightning.commands.checkpoints`), and
  :func:`find_checkpoint` resolves ``--ckpt_path last|best``.
* The callback that writes them is :class:`fp8_lightning.callbacks.checkpoint.Checkpoint`.
"""

from __future__ import annotations

import ctypes
import io
import logging
import os
import pickle
import re
import shutil
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner,
                                                          _EmptyStateDictLoadPlanner)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from typing_extensions import override

from .config import GPTConfig

log = logging.getLogger(__name__)


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
    """``torch.save`` to a temporary file beside ``path``, fsync, then rename over ``path``.

    A failed write (disk full, quota, I/O error) removes the temporary file, leaves ``path`` as it
    was and raises one :class:`CheckpointError` naming ``path`` and the reason.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_beside(path)
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:  # torch's writer reports a failed write as RuntimeError
        raise CheckpointError(_write_failure(path, err)) from None
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _write_failure(path: Path, err: BaseException) -> str:
    # torch's zip writer turns a failed write into "[enforce fail at inline_container.cc:NNN] .
    # unexpected pos ..." with the OSError (e.g. ENOSPC) as its context: report that OSError.
    cause: Optional[BaseException] = err
    while cause is not None and not (isinstance(cause, OSError) and cause.errno):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, OSError):
        reason = os.strerror(cause.errno).lower()  # e.g. "no space left on device"
    else:
        reason = re.sub(r"^\[enforce fail at [^\]]*\][\s.]*", "", str(err).strip()).split("\n")[0]
    try:
        reason += f" ({human_size(shutil.disk_usage(path.parent).free)} free there)"
    except OSError:
        pass
    return (f"could not write checkpoint {str(path)!r}: {reason or type(err).__name__}; "
            f"{path.name} was left as it was")


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
            old = temporary_beside(path, "old")
            os.replace(path, old)
            os.replace(tmp, path)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()
    else:
        os.replace(tmp, path)
    _fsync_dir(path.parent)


_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)$")


def temporary_beside(path: Path, kind: str = "tmp", pid: Optional[int] = None) -> Path:
    """``.NAME.tmp-PID`` (or ``.NAME.old-PID``) beside ``path``: where a write goes before it is
    renamed into place. Hidden, so Lightning's ``last*.ckpt`` lookup never takes one;
    :func:`remove_stale_temporaries` finds a killed write's by this name (``pid``: the writer's,
    this process's by default)."""
    return path.with_name(f".{path.name}.{kind}-{os.getpid() if pid is None else pid}")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # another user's process (PermissionError), or unsure: keep
        return True
    return True


def remove_stale_temporaries(directory: str | os.PathLike) -> list[str]:
    """Remove the ``.NAME.tmp-PID`` (and ``.NAME.old-PID``) files and directories that checkpoint
    writes killed mid-way left in ``directory`` (their PID no longer runs); returns their names.

    One is kept (with a warning) while ``NAME`` itself is missing: a sharded write killed between
    :func:`publish_directory`'s two renames leaves the only copies there. (The PID check is for
    this host: do not share a checkpoint directory between runs on several hosts.)
    """
    root = Path(directory)
    removed, kept = [], []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        match = _TEMPORARY.match(path.name)
        if not match or _running(int(match["pid"])):
            continue
        if not (root / match["name"]).exists():
            kept.append(path.name)
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path.name)
    if removed:
        log.info("checkpoints: removed %d temporar%s left by killed writes in %s: %s", len(removed),
                 "y" if len(removed) == 1 else "ies", root, ", ".join(removed))
    if kept:
        log.warning("checkpoints: kept %s in %s: the checkpoint it was written for is missing, so "
                    "it may be the only copy (rename it if `python -m fp8_lightning checkpoints` "
                    "reads it, else delete it)", ", ".join(kept), root)
    return removed


def link_copy_directory(src: Path, dst: Path) -> None:
    """``dst`` as a copy of checkpoint directory ``src`` made of hard links (no extra write)."""
    tmp = temporary_beside(dst)
    shutil.rmtree(tmp, ignore_errors=True)

    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, tmp, copy_function=link)
    publish_directory(tmp, dst)


SHARDED_META = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of the shards


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """A directory: what sharded strategies write (DCP shards plus Lightning's ``meta.pt``;
    :func:`load_checkpoint_file` says which part is missing from an incomplete one)."""
    return Path(path).is_dir()


def _unpickle_refused(what: str, found: str, allowed: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {what!r} holds a pickled object other than {allowed} "
                           f"({found}; not written by fp8-lightning): refusing to unpickle it")


def _corrupt(what: str, err: BaseException, checkpoint: str | os.PathLike) -> CheckpointError:
    message = str(err).strip().splitlines()[0][:120] if str(err).strip() else type(err).__name__
    return CheckpointError(f"checkpoint {what!r} is truncated or corrupt ({message}); use an "
                           f"older checkpoint from {str(Path(checkpoint).parent)!r}")


def _torch_load(source: Path | io.BytesIO, what: str, checkpoint: str | os.PathLike,
                map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` of ``source`` (``what``, a part of ``checkpoint``)."""
    if isinstance(source, Path) and source.is_file():
        with open(source, "rb") as f:
            head = f.read(4)
        # torch.save has written zip archives since torch 1.6; anything else (a text file, a
        # legacy or foreign pickle) is not read at all (torch's legacy reader raises IndexError
        # and the like on such bytes, not one error type).
        if head and head != b"PK\x03\x04":
            raise CheckpointError(f"checkpoint {what!r} is not a checkpoint written by torch.save "
                                  f"(not a zip archive: it starts with {head!r}); pass a .ckpt "
                                  f"file or a sharded checkpoint directory")
    try:
        return torch.load(source, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL [\w.]+", str(err))  # "Unsupported global: GLOBAL x.y", ...
        raise _unpickle_refused(what, found.group(0) if found else "a pickled object",
                                "tensors and plain types") from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, IndexError, KeyError,
            ValueError) as err:  # a zip archive whose pickle or records are cut or damaged
        raise _corrupt(what, err, checkpoint) from None


class _Refused(pickle.UnpicklingError):
    """A global outside :attr:`MetadataUnpickler.ALLOWED`."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a ``torch.distributed.checkpoint`` ``.metadata`` file and nothing else.

    Only the globals such a file references are resolved (as listed from the files that torch 2.11
    and 2.14 write for an FSDP2 model and optimizer); any other is refused before it is called.
    Names are matched exactly, so ``pathlib.Path.touch`` is not ``pathlib.Path``.
    """

    ALLOWED: dict[str, frozenset[str]] = {
        "torch.distributed.checkpoint.metadata": frozenset({
            "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata",
            "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
            "_MEM_FORMAT_ENCODING"}),
        "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
        "torch.serialization": frozenset({"_get_layout"}),  # a torch.layout by name
        # StorageMeta.checkpoint_id is the path the checkpoint was written to.
        "pathlib": frozenset({"Path", "PosixPath", "PurePosixPath", "WindowsPath",
                              "PureWindowsPath"}),
        "collections": frozenset({"OrderedDict"}),
        "builtins": frozenset({"set", "frozenset", "bytearray"}),
    }
    ALLOWED["pathlib._local"] = ALLOWED["pathlib"]  # Python >= 3.13 pickles paths from there

    def find_class(self, module: str, name: str) -> Any:
        if name in self.ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch":  # dtypes, torch.Size, memory formats and layouts only
            value = vars(torch).get(name)
            if value is torch.Size or isinstance(value, (torch.dtype, torch.memory_format,
                                                         torch.layout)):
                return value
        raise _Refused(f"GLOBAL {module}.{name}")


def read_dcp_metadata(directory: str | os.PathLike) -> Metadata:
    """The ``.metadata`` of a sharded checkpoint, unpickled by :class:`MetadataUnpickler`.

    Also refuses shard names that would lead outside the directory.
    """
    path = Path(directory) / DCP_METADATA
    what = str(path)
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except _Refused as err:
        raise _unpickle_refused(what, str(err), "checkpoint metadata") from None
    except Exception as err:  # noqa: BLE001 - only allow-listed code ran: anything else is damage
        raise _corrupt(what, err, directory) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint {what!r} is not torch.distributed.checkpoint metadata "
                              f"(found {type(metadata).__name__})")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name != Path(name).name or name in ("", ".", ".."):
            raise CheckpointError(f"checkpoint {what!r} names a shard outside its directory "
                                  f"({name!r}): refusing to read it")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` goes through :func:`read_dcp_metadata` (torch's
    own ``read_metadata`` is a plain ``pickle.load``: a crafted file runs code). Its shards' tensors
    are read by torch with ``weights_only=True``; non-tensor entries go to the planner
    (:class:`SafeLoadPlanner`)."""

    refused: Optional[CheckpointError] = None  # DCP reports a failed read as "metadata is None"

    # No **kwargs: DCP then never falls back to per-rank `__R.metadata` files (not written here).
    @override
    def read_metadata(self) -> Metadata:  # type: ignore[override]
        try:
            metadata = read_dcp_metadata(self.path)
        except CheckpointError as err:
            self.refused = err
            raise
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _WeightsOnlyBytes:
    """``load_bytes`` with ``weights_only=True``: DCP's ``DefaultLoadPlanner.load_bytes``
    unpickles non-tensor entries (optimizer hyperparameters, ...) with ``weights_only=False``."""

    def __init__(self, checkpoint: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        self.checkpoint = str(checkpoint)
        super().__init__(*args, **kwargs)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        obj = _torch_load(value, f"{self.checkpoint} (its shards' entry {fqn})", self.checkpoint)
        # The rest as DefaultLoadPlanner.load_bytes (torch 2.6 to 2.14).
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafeLoadPlanner(_WeightsOnlyBytes, DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that unpickles non-tensor entries with ``weights_only=True``."""


class _SafeEmptyStateDictLoadPlanner(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    """DCP's planner for a load into an empty dict, non-tensor entries ``weights_only``."""


def _dcp_failure(err: BaseException, reader: SafeFileSystemReader) -> BaseException:
    """The exception behind a failed DCP load: the reader's refusal, else the first rank's
    failure that DCP's ``CheckpointException`` wraps."""
    if reader.refused is not None:
        return reader.refused
    failures = getattr(err, "failures", None) or {}
    for failure in failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return inner
    return err


def safe_dcp_load(state_dict: dict[str, Any], path: str | os.PathLike) -> None:
    """``torch.distributed.checkpoint.load`` of ``path`` into ``state_dict`` (in place), through the
    allow-listed reader and planner; a refused or unreadable file is one :class:`CheckpointError`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    reader = SafeFileSystemReader(path)
    try:
        dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(path))
    except (Exception, CheckpointException) as err:
        failure = _dcp_failure(err, reader)
        if isinstance(failure, CheckpointError):
            raise failure from None
        raise


@contextmanager
def safe_lightning_dcp_loads() -> Iterator[None]:
    """Lightning's sharded-checkpoint loads (``ModelParallelStrategy.load_checkpoint``) through
    :func:`safe_dcp_load`.

    Lightning calls ``torch.distributed.checkpoint.load(state, checkpoint_id=path)``, which picks
    torch's ``FileSystemReader`` (plain ``pickle`` for ``.metadata``) and offers no way to pass
    another reader, so its private ``_distributed_checkpoint_load`` is swapped for the duration
    (lightning 2.4 to 2.6: ``lightning/fabric/strategies/model_parallel.py``).
    """
    from lightning.fabric.strategies import model_parallel

    original = model_parallel._distributed_checkpoint_load
    model_parallel._distributed_checkpoint_load = safe_dcp_load
    try:
        yield
    finally:
        model_parallel._distributed_checkpoint_load = original


def load_checkpoint_file(path: str | os.PathLike, map_location: Any = "cpu",
                         mmap: bool = False) -> dict[str, Any]:
    """Load a Lightning checkpoint with ``weights_only=True``; one clear error for bad files.

    For a sharded checkpoint (a directory) this is its ``meta.pt``: everything but the weights and
    optimizer state (``state_dict`` is absent; :func:`consolidate_checkpoint` gathers them). Its
    ``.metadata`` is read too, by the allow-listing :class:`MetadataUnpickler`, so that a crafted
    one is refused here, before anything else reads the directory.
    """
    path = Path(path)
    if is_sharded_checkpoint(path):
        missing = [n for n in (SHARDED_META, DCP_METADATA) if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"checkpoint {str(path)!r} is a directory without "
                                  f"{' and '.join(missing)}: not a complete sharded checkpoint; "
                                  f"use an older checkpoint from {str(path.parent)!r}")
        read_dcp_metadata(path)
        checkpoint = _torch_load(path / SHARDED_META, str(path / SHARDED_META), path,
                                 map_location, mmap)
        required: tuple[str, ...] = ("pytorch-lightning_version",)
    elif not path.is_file():
        near = sorted(p.name for p in path.parent.glob("*.ckpt")
                      if not p.name.startswith(".")) if path.parent.is_dir() else []
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist"
                                + (f"; in that directory: {', '.join(near)}" if near else ""))
    else:
        checkpoint = _torch_load(path, str(path), path, map_location, mmap)
        required = ("state_dict", "pytorch-lightning_version")
    if not isinstance(checkpoint, dict) or not all(k in checkpoint for k in required):
        keys = list(checkpoint)[:5] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise CheckpointError(f"checkpoint {str(path)!r} is not a Lightning checkpoint (needs "
                              f"{' and '.join(required)}; found {keys})")
    return checkpoint


def recorded_config(checkpoint: dict[str, Any], path: str | os.PathLike) -> Optional[GPTConfig]:
    """The model config a checkpoint records (``hyper_parameters['config']``, else
    ``fp8_lightning['config']``), or None; a field this version does not know is one error."""
    config = (checkpoint.get("hyper_parameters") or {}).get("config") or \
        (checkpoint.get("fp8_lightning") or {}).get("config")
    if not isinstance(config, dict):
        return None
    return GPTConfig.from_dict(config, f"model config recorded in checkpoint {str(path)!r}")


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
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    # As lightning.fabric.utilities.load._load_distributed_checkpoint, with the allow-listed
    # reader and planner (and meta.pt as already read above, weights_only).
    checkpoint: dict[str, Any] = {}
    reader = SafeFileSystemReader(path)
    try:
        # The planner makes its tensors on the default device: the CPU even when the caller
        # builds its model on a GPU (FSDP2Strategy), or every rank would hold all of it there.
        with torch.device("cpu"):
            _load_state_dict(checkpoint, storage_reader=reader,
                             planner=_SafeEmptyStateDictLoadPlanner(path), no_dist=True)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - many types for torn shards
        failure = _dcp_failure(err, reader)
        if isinstance(failure, CheckpointError):
            raise failure from None
        raise CheckpointError(f"checkpoint {str(path)!r}: its shards could not be read "
                              f"({type(failure).__name__}: "
                              f"{str(failure).strip().splitlines()[0][:200]})") from None
    checkpoint.update(meta)
    optimizers = sorted((k for k in checkpoint if re.fullmatch(r"optimizer_\d+", k)),
                        key=lambda k: int(k.split("_")[1]))
    checkpoint["optimizer_states"] = [checkpoint.pop(k) for k in optimizers]
    return checkpoint


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


def find_checkpoint(which: str, directory: str | os.PathLike) -> str:
    """The checkpoint that ``--ckpt_path last`` or ``best`` names in ``directory`` (the
    :class:`Checkpoint` callback's), or one :class:`CheckpointError` saying there is none.

    ``last``: the newest ``last*.ckpt`` (as Lightning picks it). ``best``: the lowest validation
    loss among the checkpoints whose loss was measured on their own weights (at their own step:
    the best-k ones); unreadable checkpoints are never candidates.
    """
    root = Path(directory)
    if which == "last":
        found = list(root.glob("last*.ckpt"))  # (never a hidden .last.ckpt.tmp-PID)
        if found:
            return str(max(found, key=lambda p: p.stat().st_mtime))
        wanted = "no last.ckpt to resume from"
    elif which == "best":
        rows = [r for r in (list_checkpoints(str(root)) if root.is_dir() else [])
                if "error" not in r and r["val_loss"] is not None and r["val_step"] == r["step"]]
        if rows:
            return str(root / min(rows, key=lambda r: r["val_loss"])["file"].rstrip("/"))
        wanted = "no checkpoint validated at its own step (a best-k checkpoint)"
    else:
        raise ValueError(f"find_checkpoint({which!r}): valid: last, best")
    names = sorted(p.name for p in root.glob("*.ckpt")) if root.is_dir() else []
    there = (f"it holds {', '.join(names)}" if names else "it holds no checkpoints") \
        if root.is_dir() else "it does not exist"
    raise CheckpointError(f"--ckpt_path {which}: {wanted} in {str(root)!r} ({there}); start "
                          "without --ckpt_path, or set --trainer.default_root_dir to the root "
                          "of the run whose checkpoints you mean")


def checkpoint_versions() -> dict[str, str]:
    """Versions recorded in every checkpoint: torch, lightning, TransformerEngine."""
    from .te_availability import te_version

    return {"torch": str(torch.__version__), "lightning": str(L.__version__),
            "transformer_engine": str(te_version())}


# ---------------------------------------------------------------------------------- listing
def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def describe_checkpoint(path: Path, strict: bool = False) -> dict[str, Any]:
    """One row for ``checkpoints``: step, tokens, val loss (and the step it was measured at),
    precision, size; or the error (raised where ``strict``)."""
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() \
        else path.stat().st_size
    row: dict[str, Any] = {"file": path.name + ("/" if path.is_dir() else ""), "size": size}
    try:
        ckpt = load_checkpoint_file(path, mmap=True)
    except (CheckpointError, FileNotFoundError) as err:
        if strict:
            raise
        # "checkpoint 'PATH' is truncated ..." -> "truncated ..." (errors naming a file inside a
        # sharded checkpoint keep its name)
        row["error"] = re.sub(f"^checkpoint {re.escape(repr(str(path)))} (is )?", "", str(err))
        return row
    meta = ckpt.get("fp8_lightning", {})
    row.update(step=ckpt.get("global_step"), tokens=ckpt.get("tokens_seen"),
               val_loss=meta.get("val_loss"), val_step=meta.get("val_step"),
               precision=meta.get("precision", "?"), model=meta.get("config", {}).get("name", "?"))
    return row


def list_checkpoints(directory: str) -> list[dict[str, Any]]:
    """Rows describing every ``*.ckpt`` in ``directory``, oldest step first."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
    rows = [describe_checkpoint(p) for p in sorted(root.glob("*.ckpt")) if not p.name.startswith(".")]
    return sorted(rows, key=lambda r: (r.get("step") is None, r.get("step") or 0, r["file"]))
