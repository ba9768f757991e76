"""``python -m fp8_lightning prepare``: text files -> GPT-2 BPE token shards (litdata) in
``train/`` and ``val/`` with a ``meta.json``; what :class:`~fp8_lightning.data.streaming.TokenShardDataModule`
streams. The dataset directory's layout is defined here."""

from __future__ import annotations

import glob
import json
import multiprocessing
import os
import shutil
import tempfile
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Union

from lightning.pytorch.utilities import rank_zero_info

from ..checkpoint_files import human_size, publish_directory
from ..config import ConfigError
from ..progress import Progress, tallied, tally_of
from ..tokenizer import get_tokenizer
from .documents import _tokenize_split, iter_documents

META = "meta.json"
DATASET_ENTRIES = {"train", "val", META}  # what a prepared dataset directory holds


# Chunks hold this many training blocks; each chunk is a multiple of the block so that no
# block straddles two chunks (litdata's TokensLoader drops a chunk's partial tail).
BLOCKS_PER_CHUNK = 256


def expand_inputs(inputs: list[str]) -> list[str]:
    """Paths and globs -> sorted unique files; one error listing everything that matched nothing."""
    files, missing = [], []
    for pattern in inputs:
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        matches = [m for m in matches if os.path.isfile(m)]
        (files.extend(matches) if matches else missing.append(pattern))
    bad_ext = [f for f in files if not f.endswith((".txt", ".jsonl"))]
    problems = [f"inputs: {p!r} matches no file" for p in missing]
    problems += [f"inputs: {f!r} is neither .txt nor .jsonl" for f in bad_ext]
    if problems:
        raise ConfigError(problems, "prepare inputs")
    return sorted(dict.fromkeys(files))


def _split_size(split_dir: Path, block: int) -> tuple[int, int, int]:
    """(tokens, chunks, blocks of ``block`` tokens) recorded in a litdata index.json."""
    chunks = json.loads((split_dir / "index.json").read_text())["chunks"]
    # TokensLoader reads whole blocks within a chunk: a chunk's partial tail is never read.
    return (sum(c["dim"] for c in chunks), len(chunks), sum(c["dim"] // block for c in chunks))


def _split_counts(tokens: int, val_fraction: float) -> tuple[int, int]:
    """(train, val) tokens of a file of ``tokens`` tokens: val is its last ``val_fraction``."""
    val = int(tokens * val_fraction)
    return tokens - val, val


def _scan_inputs(files: list[str], tok: Any, text_field: str, val_fraction: float,
                 block: int, scanned: Optional[list[str]] = None) -> tuple[int, int, int]:
    """Read every document once, in this process, before anything is written: a bad input is one
    error listing every file's first problem (not a failure in a litdata worker).

    Returns (documents, train tokens, val tokens). The tokens are counted until both splits surely
    hold a block (counts only grow with more text), so a large corpus is not tokenized twice; a
    count below ``block`` is therefore exact. Each file read is appended to ``scanned``."""
    problems, documents, train, val = [], 0, 0, 0
    for path in files:
        tokens = 0
        try:
            for doc in iter_documents(path, text_field):
                documents += 1
                file_train, file_val = _split_counts(tokens, val_fraction)
                if min(train + file_train, val + file_val) < block:
                    tokens += len(tok.encode(doc)) + 1  # + end-of-text
        except ConfigError as err:
            problems += err.problems
        file_train, file_val = _split_counts(tokens, val_fraction)
        train, val = train + file_train, val + file_val
        if scanned is not None:
            scanned.append(path)
    if problems:
        raise ConfigError(problems, "prepare inputs")
    return documents, train, val


def _check_output_dir(out: Path) -> None:
    """Refuse, before any work, an output_dir that prepare cannot write or would damage: prepare
    replaces the whole directory, so it must be new, empty or a prepared dataset."""
    where = f"output_dir={str(out)!r}"
    if out.exists() and not out.is_dir():
        raise ConfigError([f"{where} is an existing file; valid: a new directory, an empty one "
                           "or a prepared dataset to replace"], "prepare output")
    if out.is_dir():
        other = sorted(p.name for p in out.iterdir() if p.name not in DATASET_ENTRIES)
        if other:
            raise ConfigError([f"{where} is a directory that is not a prepared dataset (it holds "
                               f"{', '.join(other[:5])}{', ...' if len(other) > 5 else ''}); "
                               "prepare replaces the whole directory: choose a new or empty "
                               "one"], "prepare output")
    # The dataset is written beside output_dir and renamed into place; the old one is deleted.
    parent = next(p for p in out.parents if p.exists())
    for directory in [parent] + ([out] if out.is_dir() else []):
        try:
            if not directory.is_dir():
                raise NotADirectoryError(20, "not a directory")
            with tempfile.TemporaryFile(dir=directory):
                pass
        except OSError as err:
            raise ConfigError([f"{where}: cannot write in {directory} ({err.strerror}); choose "
                               "a writable location"], "prepare output") from None


def _progress(what: str, sizes: dict[str, int], done_files: Callable[[], list[str]]) -> Progress:
    """Progress lines for a pass over the input files: the bytes of the files ``done_files()``
    lists of all the files' bytes (a file counts once it is done: the workers report no finer)."""
    return Progress(what, sum(sizes.values()),
                    lambda: sum(sizes.get(path, 0) for path in set(done_files())),
                    say=rank_zero_info, fmt=human_size)


def prepare(inputs: Union[str, list[str]], output_dir: str, tokenizer: str = "gpt2", text_field: str = "text",
            val_fraction: float = 0.05, seq_len: int = 1024, num_workers: Optional[int] = None
            ) -> dict[str, Any]:
    """Tokenize ``.txt`` / ``.jsonl`` files into litdata shards for ``TokenShardDataModule``.

    Args:
        inputs: a file, a glob (``'data/*.jsonl'``) or a list of them; a .txt file is one document, a .jsonl file holds
            one document per line in ``text_field``.
        output_dir: where ``train/``, ``val/`` and ``meta.json`` are written: a new or empty
            directory, or a prepared dataset, which is replaced only once the new one is complete.
        tokenizer: ``gpt2`` (offline GPT-2 BPE) or the path of a Hugging Face ``tokenizer.json``.
        text_field: the JSON field holding the text in ``.jsonl`` inputs.
        val_fraction: the share of every file's tokens (its end) kept for validation.
        seq_len: the training sequence length; chunks are a multiple of ``seq_len + 1`` tokens.
        num_workers: tokenizer processes (default: one per file, at most 8). Worker k tokenizes
            the k-th contiguous slice of the sorted files, so the same inputs and ``num_workers``
            give the same shards on any machine; another ``num_workers`` cuts other chunks.
    """
    from litdata import optimize
    from litdata.streaming.item_loader import TokensLoader

    problems = []
    if not 0.0 < val_fraction < 1.0:
        problems.append(f"val_fraction={val_fraction} must be between 0 and 1 (e.g. 0.05)")
    if seq_len <= 0:
        problems.append(f"seq_len={seq_len} must be a positive integer")
    if num_workers is not None and (not isinstance(num_workers, int) or num_workers < 1):
        problems.append(f"num_workers={num_workers!r} must be a positive integer (or unset: one "
                        "per file, at most 8)")
    if problems:
        raise ConfigError(problems, "prepare arguments")
    files = expand_inputs([inputs] if isinstance(inputs, str) else list(inputs))
    tok = get_tokenizer(tokenizer)
    out = Path(output_dir).expanduser().resolve()
    _check_output_dir(out)
    block = seq_len + 1
    sizes = {path: os.path.getsize(path) for path in files}
    scanned: list[str] = []
    with _progress("prepare: reading inputs", sizes, lambda: scanned):
        documents, train_tokens, val_tokens = _scan_inputs(files, tok, text_field, val_fraction,
                                                           block, scanned)
    problems = []
    if train_tokens < block:
        problems.append(f"the train split would have {train_tokens} tokens, fewer than one block of "
                        f"seq_len+1={block}: lower seq_len, lower val_fraction={val_fraction} or "
                        "add data")
    if val_tokens < block:
        problems.append(f"the val split would have {val_tokens} tokens (val_fraction={val_fraction} "
                        f"of every file), fewer than one block of seq_len+1={block}: lower seq_len, "
                        "raise val_fraction or add data")
    if problems:
        raise ConfigError(problems, f"prepare ({documents} documents in {len(files)} file(s))")

    # Not the CPU count: the worker count decides the chunk layout, and a dataset prepared on
    # another machine must come out the same.
    workers = num_workers or min(len(files), 8)
    # Written beside output_dir and swapped into place when complete: a failed or interrupted
    # prepare leaves the dataset that was there untouched.
    tmp = out.with_name(f".{out.name}.prepare-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)  # (not mkdtemp: its 0700 would become the dataset's permissions)
    # litdata's optimize sets the process-wide start method (spawn) and leaves it so: every data
    # loader of the process would then spawn its workers, re-importing torch at each epoch (a
    # stall per epoch).
    start_method = multiprocessing.get_start_method(allow_none=True)
    try:
        for split in ("train", "val"):
            rank_zero_info(f"prepare: tokenizing {len(files)} file(s) -> {out / split}")
            # Workers record each file they finish in `tally` (removed before the directory
            # becomes the dataset); the progress lines count those files' bytes.
            tally = str(tmp / f".{split}-done")
            tokenize = partial(_tokenize_split, split=split, tokenizer=tokenizer,
                               text_field=text_field, val_fraction=val_fraction)
            with _progress(f"prepare: tokenizing {split}", sizes, partial(tally_of, tally)):
                optimize(
                    fn=partial(tallied, fn=tokenize, tally=tally),
                    inputs=files, output_dir=str(tmp / split),
                    chunk_size=block * BLOCKS_PER_CHUNK, item_loader=TokensLoader(),
                    num_workers=workers, mode="overwrite",
                    start_method="spawn" if workers > 1 else None,
                    # litdata's default hands files to whichever worker is free and names chunks
                    # by worker: each run ordered the same data differently. A fixed in-order
                    # slice per worker, files in sorted order (not by size), makes the shards
                    # reproducible.
                    keep_data_ordered=True, reorder_files=False,
                    # litdata's own chatter (an account advert, worker start/stop lines, the
                    # temporary directory) says nothing a user acts on; its errors still raise.
                    # Its progress bar comes only with that chatter and writes carriage returns
                    # into a log file: the lines of _progress replace it.
                    verbose=False,
                )
            Path(tally).unlink(missing_ok=True)
        train_tokens, train_chunks, train_blocks = _split_size(tmp / "train", block)
        val_tokens, val_chunks, val_blocks = _split_size(tmp / "val", block)
        # Each worker's last chunk drops its partial block: many workers on little data can
        # leave a split without a whole block although its token count is enough.
        short = [split for split, n in (("train", train_blocks), ("val", val_blocks)) if not n]
        if short:
            raise ConfigError([f"the {split} split came out with no whole block of seq_len+1="
                               f"{block} tokens (its tokens are split among num_workers="
                               f"{workers}); lower num_workers or seq_len, or add data"
                               for split in short], "prepare")
        meta = dict(tokenizer=tok.name if tokenizer == "gpt2" else str(Path(tokenizer).resolve()),
                    vocab_size=tok.vocab_size, eot_id=tok.eot_id, seq_len=seq_len, files=files,
                    num_workers=workers, documents=documents, train_tokens=train_tokens,
                    val_tokens=val_tokens, shards=train_chunks + val_chunks)
        (tmp / META).write_text(json.dumps(meta, indent=2))
        publish_directory(tmp, out)
    finally:
        multiprocessing.set_start_method(start_method, force=True)
        shutil.rmtree(tmp, ignore_errors=True)
    rank_zero_info(f"prepare: {documents:,} documents, {train_tokens:,} train + {val_tokens:,} val "
                   f"tokens, {train_chunks + val_chunks} shards -> {out}")
    return meta

