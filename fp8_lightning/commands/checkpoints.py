"""``python -m fp8_lightning checkpoints DIR`` (the checkpoints of a run, with their step, tokens,
validation loss, precision and size) and ``consolidate DIR`` (a sharded checkpoint gathered into
one file for one GPU or the CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ..checkpoint import (DCP_METADATA, SHARDED_META, CheckpointError, atomic_torch_save,
                          consolidate_checkpoint, describe_checkpoint, human_size,
                          is_sharded_checkpoint, list_checkpoints, load_checkpoint_file)


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


def format_checkpoints(rows: list[dict[str, Any]]) -> str:
    header = ("file", "step", "tokens", "val loss", "precision", "model", "size")
    lines = []
    for r in rows:
        if "error" in r:
            lines.append((r["file"], "-", "-", "-", f"UNREADABLE: {r['error']}", "-", human_size(r["size"])))
            continue
        val = "-" if r["val_loss"] is None else f"{r['val_loss']:.4f}"
        if r["val_loss"] is not None and r.get("val_step") != r["step"]:  # an older validation's
            val += f" @step {'?' if r.get('val_step') is None else r['val_step']}"
        tokens = "-" if r["tokens"] is None else f"{r['tokens']:,}"
        lines.append((r["file"], str(r["step"]), tokens, val, r["precision"], r["model"],
                      human_size(r["size"])))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)] if lines else []
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths))] if lines else []
    out += ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)) for line in lines]
    return "\n".join(out) if out else "(no checkpoints)"


def checkpoints(directory: str) -> None:
    """List the checkpoints in DIRECTORY: step, tokens seen, validation loss, precision, size.

    The validation loss is the last one measured before the checkpoint was written. Where that
    validation ran at an earlier step than the checkpoint's (``last.ckpt`` is written after
    further training steps), the step it measured is shown with it: ``3.2100 @step 100`` (``@step
    ?``: a checkpoint from a version that did not record it). Unreadable checkpoints are listed
    with the reason.

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
