"""Data: ``prepare`` tokenizes text into litdata shards; ``TokenShardDataModule`` streams them.

A prepared dataset is a directory (local, or any ``input_dir`` litdata accepts such as s3://)::

    DIR/train/   litdata chunks of token ids (documents joined by end-of-text)
    DIR/val/     the last ``val_fraction`` of every input file's tokens
    DIR/meta.json  tokenizer, vocabulary size, counts

litdata is imported lazily: importing ``fp8_lightning`` does not start its machinery.
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import multiprocessing
import os
import random
import shutil
import tempfile
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from .checkpoint import CheckpointError, publish_directory
from .config import ConfigError, check_micro_batch
from .documents import _tokenize_split, iter_documents
from .tokenizer import ASSETS, get_tokenizer, tokenizer_key

log = logging.getLogger(__name__)

EMBEDDED_CORPUS = ASSETS / "tinyshakespeare.txt"
EMBEDDED_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
META = "meta.json"
DATASET_ENTRIES = {"train", "val", META}  # what a prepared dataset directory holds
REPREPARE = "re-run `python -m fp8_lightning prepare` to rebuild the dataset"
# Chunks hold this many training blocks; each chunk is a multiple of the block so that no
# block straddles two chunks (litdata's TokensLoader drops a chunk's partial tail).
BLOCKS_PER_CHUNK = 256


@contextmanager
def preserved_rng() -> Iterator[None]:
    """Leave the Python, NumPy and torch (CPU) generators as they were before the block."""
    import numpy as np

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


def default_cache_dir() -> Path:
    return Path(os.environ.get("FP8L_CACHE", Path.home() / ".cache" / "fp8_lightning"))


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
                 block: int) -> tuple[int, int, int]:
    """Read every document once, in this process, before anything is written: a bad input is one
    error listing every file's first problem (not a failure in a litdata worker).

    Returns (documents, train tokens, val tokens). The tokens are counted until both splits surely
    hold a block (counts only grow with more text), so a large corpus is not tokenized twice; a
    count below ``block`` is therefore exact."""
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
    documents, train_tokens, val_tokens = _scan_inputs(files, tok, text_field, val_fraction, block)
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
    # 5-20 s stall per epoch on the GPU machine, the first fit after preparing the default data).
    start_method = multiprocessing.get_start_method(allow_none=True)
    try:
        for split in ("train", "val"):
            rank_zero_info(f"prepare: tokenizing {len(files)} file(s) -> {out / split}")
            optimize(
                fn=partial(_tokenize_split, split=split, tokenizer=tokenizer,
                           text_field=text_field, val_fraction=val_fraction),
                inputs=files, output_dir=str(tmp / split), chunk_size=block * BLOCKS_PER_CHUNK,
                item_loader=TokensLoader(), num_workers=workers, mode="overwrite",
                start_method="spawn" if workers > 1 else None,
                # litdata's default hands files to whichever worker is free and names chunks by
                # worker: each run ordered the same data differently. A fixed in-order slice per
                # worker, files in sorted order (not by size), makes the shards reproducible.
                keep_data_ordered=True, reorder_files=False,
                # litdata's own chatter (an account advert, worker start/stop lines, the temporary
                # directory, progress bars) says nothing a user acts on; its errors still raise.
                verbose=False,
            )
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


def _index_layout_problem(data: Any) -> Optional[str]:
    """What a parsed index.json lacks that litdata's reader needs (None: nothing)."""
    if not isinstance(data, dict):
        return "it is not a JSON object"
    for key, kind in (("chunks", list), ("config", dict)):
        if not isinstance(data.get(key), kind):
            return f"no {key!r} {'list' if kind is list else 'object'}"
    absent = [k for k in ("compression", "data_format", "data_spec", "item_loader")
              if k not in data["config"]]
    if absent:
        return f"its 'config' has no {', '.join(map(repr, absent))}"
    if data["config"]["item_loader"] != "TokensLoader":
        return (f"its item_loader is {data['config']['item_loader']!r}, not 'TokensLoader' (not "
                "a dataset written by prepare)")
    for i, chunk in enumerate(data["chunks"]):
        absent = [k for k in ("filename", "chunk_bytes", "chunk_size", "dim")
                  if not isinstance(chunk, dict) or k not in chunk]
        if absent:
            return f"chunk {i} has no {', '.join(map(repr, absent))}"
    return None


def _check_split(split_dir: Path) -> list[str]:
    """Problems of a local split: an index.json litdata cannot read, or a chunk file that is
    missing or not the size its index records (litdata would wait for it, then time out)."""
    index = split_dir / "index.json"
    try:
        data = json.loads(index.read_text())
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        return [f"{index} is not valid JSON ({err})"]
    why = _index_layout_problem(data)
    if why:
        return [f"{index} is not a valid litdata index: {why}"]
    problems = []
    for chunk in data["chunks"]:
        path, size = split_dir / str(chunk["filename"]), chunk["chunk_bytes"]
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif path.stat().st_size != size:
            problems.append(f"{path} has {path.stat().st_size} bytes where {index.name} records "
                            f"{size} (truncated or overwritten)")
    return problems


@functools.cache
def _checked_loader_class() -> type:
    """litdata's StreamingDataLoader, checking every batch's token ids (built on first use: litdata
    is imported lazily)."""
    from litdata import StreamingDataLoader

    class CheckedStreamingDataLoader(StreamingDataLoader):
        """Token ids outside the vocabulary (a corrupt shard, another tokenizer's dataset) would be
        an IndexError deep in the embedding, or a device-side assert on a GPU. The batch is checked
        here, on the CPU in the main process before Lightning moves it to the device: one min/max
        over a few thousand ints, no device sync. (Raised in a loader worker, the error would come
        back wrapped in the worker's traceback.)"""

        def __init__(self, *args: Any, vocab_size: Optional[int], where: str, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.vocab_size, self.where = vocab_size, where

        def __iter__(self) -> Iterator[Any]:
            for batch in super().__iter__():
                if self.vocab_size is not None and batch.numel():
                    low, high = (int(v) for v in torch.aminmax(batch))
                    if low < 0 or high >= self.vocab_size:
                        bad = high if high >= self.vocab_size else low
                        raise ConfigError([
                            f"{self.where}: a batch holds token id {bad}, outside the vocabulary "
                            f"(0..{self.vocab_size - 1}): a shard is corrupt or was made with "
                            f"another tokenizer; {REPREPARE}"], "data")
                yield batch

    return CheckedStreamingDataLoader


class TokenShardDataModule(L.LightningDataModule):
    """Streams token blocks of ``seq_len + 1`` from litdata shards made by ``prepare``.

    Args:
        data_dir: a prepared dataset (local dir or any litdata input_dir such as s3://bucket/ds).
            Default: the tinyshakespeare corpus that ships with the package, prepared on first use
            into ``cache_dir`` (no network).
        seq_len: tokens per training sequence (the CLI sets it to the model's block_size).
        batch_size: sequences per micro-batch on each device.
        num_workers: loader processes per device.
        tokenizer: tokenizer used to prepare the embedded default (``gpt2`` or a tokenizer.json).
        shuffle: shuffle training blocks (deterministically, from ``seed``).
        seed: the shuffle seed.
        cache_dir: where the embedded default is prepared (default ``~/.cache/fp8_lightning`` or
            ``$FP8L_CACHE``).
        emulate_ranks: on one device, read the sample order of this many data-parallel ranks,
            one rank per micro-batch (set ``trainer.accumulate_grad_batches`` to the same N): a
            single-GPU reference that sees at every optimizer step exactly the samples an N-GPU
            run with the same ``batch_size`` and ``num_workers`` sees. Such a run cannot resume.
    """

    def __init__(self, data_dir: Optional[str] = None, seq_len: int = 1024, batch_size: int = 8,
                 num_workers: int = 2, tokenizer: str = "gpt2", shuffle: bool = True,
                 seed: int = 42, cache_dir: Optional[str] = None,
                 emulate_ranks: Optional[int] = None) -> None:
        super().__init__()
        problems = []
        if emulate_ranks is not None and (not isinstance(emulate_ranks, int) or emulate_ranks < 1):
            problems.append(f"data.emulate_ranks={emulate_ranks!r} must be a positive integer")
        for key, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if not isinstance(value, int) or value <= 0:
                problems.append(f"data.{key}={value!r} must be a positive integer")
        if num_workers < 0:
            problems.append(f"data.num_workers={num_workers} must be >= 0")
        if problems:
            raise ConfigError(problems, "data")
        check_micro_batch(batch_size, seq_len)
        self.data_dir, self.seq_len, self.batch_size = data_dir, seq_len, batch_size
        self.num_workers, self.tokenizer, self.shuffle, self.seed = num_workers, tokenizer, shuffle, seed
        self.emulate_ranks = emulate_ranks
        self._rank_datasets: list[Any] = []
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.meta: dict[str, Any] = {}
        self.train_dataset = self.val_dataset = None
        self._train_loader: Any = None
        self._resume: Optional[dict[str, Any]] = None  # our state from the checkpoint, to verify

    @functools.cached_property  # (hashes the tokenizer's files: once, not at every use)
    def dataset_dir(self) -> str:
        if self.data_dir:
            return self.data_dir.rstrip("/")
        tok = "gpt2"
        if self.tokenizer != "gpt2":  # by content: two tokenizer.json files are two caches
            key = tokenizer_key(self.tokenizer)  # (no file there: get_tokenizer says so later)
            tok = f"{Path(self.tokenizer).stem}-{key[7:19] if key.startswith('sha256:') else '?'}"
        return str(self.cache_dir / f"tinyshakespeare-{tok}-s{self.seq_len}")

    @property
    def is_remote(self) -> bool:
        return "://" in self.dataset_dir

    def prepare_data(self) -> None:
        """Prepare the embedded corpus once (rank 0); a user dataset is only checked."""
        if self.data_dir:
            return
        if (Path(self.dataset_dir) / META).is_file():
            return
        rank_zero_info(f"data: preparing the embedded tinyshakespeare corpus -> {self.dataset_dir}")
        # litdata's optimize draws from the global generators, and the model is initialised after
        # prepare_data: without this, a cold cache would change the weights a seed gives.
        with preserved_rng():
            prepare([str(EMBEDDED_CORPUS)], self.dataset_dir, tokenizer=self.tokenizer,
                    seq_len=self.seq_len, val_fraction=0.1, num_workers=1)

    def _check_local(self) -> None:
        root = Path(self.dataset_dir)
        if not root.is_dir():
            raise FileNotFoundError(f"data.data_dir={self.dataset_dir!r} does not exist; make one "
                                    "with: python -m fp8_lightning prepare --inputs FILES "
                                    "--output_dir DIR")
        missing = [s for s in ("train", "val") if not (root / s / "index.json").is_file()]
        if missing:
            raise FileNotFoundError(
                f"data.data_dir={self.dataset_dir!r} is not a prepared dataset: no "
                f"{' or '.join(m + '/index.json' for m in missing)} (run `python -m fp8_lightning "
                "prepare` on your text first)")
        problems = [p for split in ("train", "val") for p in _check_split(root / split)]
        if (root / META).is_file():
            try:
                self.meta = json.loads((root / META).read_text())
                int(self.meta.get("vocab_size", 0))  # the token ids are checked against it
            except (ValueError, TypeError, AttributeError) as err:
                problems.append(f"{root / META} is not a valid dataset description ({err})")
        if problems:
            raise ConfigError([f"data.data_dir={self.dataset_dir!r}: {p}" for p in problems]
                              + [REPREPARE], "data")

    def setup(self, stage: str) -> None:
        # Datasets are built here, not in __init__: litdata reads the distributed environment
        # (rank, world size) when a StreamingDataset is constructed.
        from litdata import StreamingDataset
        from litdata.streaming.item_loader import TokensLoader

        if not self.is_remote:
            self._check_local()
        block = self.seq_len + 1
        make = lambda split, shuffle: StreamingDataset(  # noqa: E731
            input_dir=f"{self.dataset_dir}/{split}", item_loader=TokensLoader(block_size=block),
            shuffle=shuffle, drop_last=True, seed=self.seed)
        self.train_dataset = make("train", self.shuffle)
        self.val_dataset = make("val", False)
        rank_zero_info(f"data: {self.dataset_dir}: {len(self.train_dataset):,} train / "
                       f"{len(self.val_dataset):,} val blocks of {block} tokens")
        if self.emulate_ranks and stage == "fit":
            self._rank_datasets = self._emulated_ranks(make)
        checks = []
        if stage == "fit":
            checks.append(("train", (self._rank_datasets or [self.train_dataset])[0], "no step"))
        # Validation and test read the val split (unless the run turns validation off).
        if stage in ("fit", "validate", "test") and getattr(self.trainer, "limit_val_batches", 1):
            checks.append(("val", self.val_dataset, "no batch"))
        problems = [p for p in (self._too_few_blocks(*check) for check in checks) if p]
        if problems:
            raise ConfigError(problems, "data")

    def _too_few_blocks(self, split: str, dataset: Any, runs: str) -> Optional[str]:
        """A split that gives a rank no full micro-batch (litdata drops the partial one): the run
        would train or validate on nothing and still exit 0."""
        blocks = dataset.get_len(1, 1)  # this rank's blocks
        # What litdata yields this rank per epoch with this batch size and worker count.
        samples = dataset.get_len(self.num_workers, self.batch_size)
        if samples >= self.batch_size:
            return None
        world = dataset.distributed_env.world_size
        return (f"data.data_dir={self.dataset_dir!r}: the {split} split has {blocks} blocks of "
                f"seq_len+1={self.seq_len + 1} tokens per rank ({world} rank(s)), not one full "
                f"micro-batch of data.batch_size={self.batch_size} with data.num_workers="
                f"{self.num_workers} ({split} would run {runs}); lower data.batch_size, "
                "data.num_workers or seq_len, or prepare more data")

    def _emulated_ranks(self, make: Any) -> list[Any]:
        """One training dataset per emulated rank, each told it is rank k of N (litdata assigns
        chunks to ranks from ``distributed_env``, read once at construction)."""
        from litdata.utilities.env import _DistributedEnv

        n = self.emulate_ranks
        trainer = getattr(self, "trainer", None)
        problems = []
        if trainer is not None and trainer.world_size != 1:
            problems.append(f"data.emulate_ranks={n} emulates ranks on one device; this run has "
                            f"{trainer.world_size} (use it with trainer.devices 1)")
        if trainer is not None and trainer.accumulate_grad_batches != n:
            problems.append(f"data.emulate_ranks={n} needs trainer.accumulate_grad_batches={n} "
                            f"(one micro-batch per emulated rank per step); it is "
                            f"{trainer.accumulate_grad_batches}")
        if problems:
            raise ConfigError(problems, "data")
        datasets = []
        for rank in range(n):
            ds = make("train", self.shuffle)
            ds.distributed_env = _DistributedEnv(world_size=n, global_rank=rank, num_nodes=1)
            datasets.append(ds)
        rank_zero_info(f"data: emulating {n} data-parallel ranks on one device (micro-batch i of "
                       f"each step reads rank i's samples)")
        return datasets

    def _loader(self, dataset: Any, split: str) -> Any:
        return _checked_loader_class()(dataset, batch_size=self.batch_size,
                                       num_workers=self.num_workers, drop_last=True,
                                       pin_memory=torch.cuda.is_available(),
                                       vocab_size=self._vocab_size(), where=f"data.data_dir="
                                       f"{self.dataset_dir!r} ({split} split)")

    def _vocab_size(self) -> Optional[int]:
        """Token ids must be below this: the dataset's tokenizer, else the model's vocabulary."""
        if self.meta.get("vocab_size"):
            return int(self.meta["vocab_size"])
        config = getattr(getattr(self.trainer, "lightning_module", None), "config", None)
        return getattr(config, "vocab_size", None)

    def train_dataloader(self) -> Any:
        if self._rank_datasets:
            self._train_loader = None  # no resumable loader state (see emulate_ranks)
            return _Interleaved([self._loader(ds, "train") for ds in self._rank_datasets])
        self._train_loader = self._loader(self.train_dataset, "train")
        return self._train_loader

    # ------------------------------------------------------------------ exact resume
    # Lightning saves and restores the StreamingDataLoader's own state (checkpoint
    # ``loops.fit_loop.state_dict.combined_loader``). This module records what it expects that
    # state to be and, when training starts again, checks the restored loader really is there:
    # a resume that would silently replay or skip data stops instead.

    def _position(self) -> Optional[int]:
        """Training blocks consumed this epoch, over all ranks (litdata's sample_in_epoch)."""
        loader = self._train_loader
        if loader is None or not hasattr(loader, "_num_samples_yielded_streaming"):
            return None
        world = getattr(self.train_dataset.distributed_env, "world_size", 1)
        dropped = getattr(self.train_dataset, "_elastic_drop_first", None) or 0
        return dropped + loader._num_samples_yielded_streaming * world

    def _identity(self) -> dict[str, Any]:
        """What a resume must not change: the blocks and their order."""
        return {"data_dir": self.dataset_dir, "seq_len": self.seq_len, "shuffle": self.shuffle,
                "seed": self.seed}

    def state_dict(self) -> dict[str, Any]:
        return {**self._identity(), "batch_size": self.batch_size, "position": self._position(),
                "emulate_ranks": self.emulate_ranks,
                "epoch": getattr(self._train_loader, "current_epoch", None)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        why = {"seq_len": "blocks would be cut differently: data would be replayed or skipped",
               "data_dir": "another dataset", "shuffle": "another sample order",
               "seed": "another sample order"}
        problems = [f"data.{key}={value!r} but the checkpoint was trained with "
                    f"{state_dict[key]!r} ({why[key]})"
                    for key, value in self._identity().items()
                    if key in state_dict and state_dict[key] != value]
        if self.emulate_ranks or state_dict.get("emulate_ranks"):
            problems.append(f"data.emulate_ranks={state_dict.get('emulate_ranks') or self.emulate_ranks}"
                            ": a reference run that emulates ranks cannot resume (nor be resumed)")
        if problems:
            raise ConfigError(problems + ["resume with the checkpoint's values, or start a new run "
                                          "without --ckpt_path"], "data for this checkpoint")
        if state_dict.get("batch_size") not in (None, self.batch_size):
            rank_zero_info(f"data: batch_size {state_dict['batch_size']} -> {self.batch_size}: "
                           "litdata resumes the same sample stream at the same position")
        self._resume = dict(state_dict)

    def verify_resumed(self) -> None:
        """Called when training starts: the loader must continue where the checkpoint stopped."""
        expected, self._resume = self._resume, None
        if not expected or not expected.get("position"):
            return
        position = self._position()
        if position is None:
            raise CheckpointError("resume: the training loader has no litdata state to verify; data "
                               "would restart from the beginning of the epoch")
        loader = self._train_loader
        if position != expected["position"] or not getattr(loader, "restore", True):
            raise CheckpointError(
                f"resume: the checkpoint's data position is block {expected['position']} of epoch "
                f"{expected['epoch']} but the restored loader is at block {position} (restore="
                f"{getattr(loader, 'restore', None)}); continuing would replay or skip data. With "
                "a changed batch size or number of devices, choose one that divides the position.")
        rank_zero_info(f"data: resumed at block {position} of epoch {expected['epoch']} (verified)")

    def val_dataloader(self) -> Any:
        return self._loader(self.val_dataset, "val")

    def test_dataloader(self) -> Any:
        return self._loader(self.val_dataset, "val")


class _Interleaved:
    """Micro-batch ``i`` of each round from loader ``i`` (one emulated rank per loader)."""

    def __init__(self, loaders: list[Any]) -> None:
        self.loaders = loaders

    def __iter__(self) -> Any:
        for batches in zip(*self.loaders):
            yield from batches

    def __len__(self) -> int:
        return min(len(loader) for loader in self.loaders) * len(self.loaders)
