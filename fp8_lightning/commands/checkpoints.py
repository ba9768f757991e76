"""``python -m fp8_lightning checkpoints DIR`` (the checkpoints of a run, with their step, tokens,
validation loss, precision and size) and ``consolidate DIR`` (a sharded checkpoint gathered into
one file for one GPU or the CPU)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Optional

from ..checkpoint_files import (DCP_METADATA, SHARDED_META, CheckpointError, atomic_torch_save,
                          consolidate_checkpoint, describe_checkpoint, human_size,
                          is_sharded_checkpoint, list_checkpoints, load_checkpoint_file,
                          temporary_beside)
from ..progress import Progress


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
    shards = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
    with Progress(f"consolidate: reading {src}", shards, fmt=human_size,
                  done=partial(_bytes_read, since=_bytes_read())):
        checkpoint = consolidate_checkpoint(src)
    dst = Path(output) if output else \
        src.with_name(f"consolidated-step{int(checkpoint.get('global_step', 0)):07d}.ckpt")
    # The file holds the shards' tensors: about their size. atomic_torch_save writes it under
    # this temporary name and renames it when complete.
    written = temporary_beside(dst)
    with Progress(f"consolidate: writing {dst}", shards, fmt=human_size,
                  done=lambda: written.stat().st_size if written.exists() else 0):
        atomic_torch_save(checkpoint, dst)
    size = dst.stat().st_size
    print(f"{dst} ({size / 2**20:.1f} MB): one file, loads on one GPU or the CPU")
    return str(dst)


def _bytes_read(since: Optional[int] = 0) -> Optional[int]:
    """Bytes this process has read (Linux's ``/proc/self/io``) beyond ``since``; None elsewhere
    or where ``since`` is None. torch's checkpoint reader reports nothing and is made inside
    consolidate_checkpoint, so its reads are counted from outside."""
    try:
        with open("/proc/self/io") as f:
            read = next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    except (OSError, StopIteration, ValueError):
        return None
    return None if since is None else read - since


def val_loss_text(row: dict[str, Any]) -> str:
    """The "val loss" cell: a number only where it was measured on this file's weights. A loss
    from an earlier step (``last.ckpt`` is written after further training) is read as the file's
    own wherever it stands alone, so it is shown as that step's."""
    loss, val_step, step = row["val_loss"], row.get("val_step"), row["step"]
    if loss is None:
        return "-"
    if val_step == step:
        return f"{loss:.4f}"
    if val_step is None:  # written by a version that did not record the step
        return f"unknown ({loss:.4f} at an unrecorded step)"
    return f"none at step {step} ({loss:.4f} was step {val_step}'s)"


def format_checkpoints(rows: list[dict[str, Any]]) -> str:
    header = ("file", "step", "tokens", "val loss", "precision", "model", "size")
    lines = []
    for r in rows:
        if "error" in r:
            lines.append((r["file"], "-", "-", "-", f"UNREADABLE: {r['error']}", "-", human_size(r["size"])))
            continue
        val = val_loss_text(r)
        tokens = "-" if r["tokens"] is None else f"{r['tokens']:,}"
        lines.append((r["file"], str(r["step"]), tokens, val, r["precision"], r["model"],
                      human_size(r["size"])))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)] if lines else []
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths))] if lines else []
    out += ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)) for line in lines]
    return "\n".join(out) if out else "(no checkpoints)"


def checkpoints(directory: str) -> None:
    """List the checkpoints in DIRECTORY: step, tokens seen, validation loss, precision, size.

    The validation loss is shown where it was measured on the checkpoint's own weights. Where
    the last validation before the checkpoint ran at an earlier step (``last.ckpt`` is written
    after further training steps), the file has none of its own: ``none at step 120 (3.2100 was
    step 100's)`` (``unknown (3.2100 at an unrecorded step)``: a checkpoint from a version that
    did not record the step). Unreadable checkpoints are listed with the reason.

    Args:
        directory: a checkpoint directory (e.g. runs/quickstart/checkpoints), a run root that
            contains one, or one checkpoint (a file or a sharded checkpoint's directory; an
            unreadable one is then an error).
    """
    root = Path(directory)
    if root.is_file() or (root / SHARDED_META).exists() or (root / DCP_METADATA).exists():
        print(format_checkpoints([describe_checkpoint(root, strict=True)]))
        return
    if root.is_dir() and not any(root.glob("*.ckpt")) and (root / "checkpoints").is_dir():
        root = root / "checkpoints"
    rows = list_checkpoints(str(root))
    print(f"{root}:")
    print(format_checkpoints(rows))
