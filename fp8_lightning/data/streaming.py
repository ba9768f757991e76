"""``TokenShardDataModule`` streams what ``prepare`` (:mod:`fp8_lightning.data.prepare`) wrote.

A prepared dataset is a directory (local, or any ``input_dir`` litdata accepts such as s3://)::

    DIR/train/   litdata chunks of token ids (documents joined by end-of-text)
    DIR/val/     the last ``val_fraction`` of every input file's tokens
    DIR/meta.json  tokenizer, vocabulary size, counts

litdata is imported lazily: importing ``fp8_lightning`` does not start its machinery.
"""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing
import os
import random
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from ..checkpoint_files import CheckpointError
from ..config import ConfigError, check_micro_batch
from ..tokenizer import ASSETS, tokenizer_key
from .prepare import META, prepare

log = logging.getLogger(__name__)

EMBEDDED_CORPUS = ASSETS / "tinyshakespeare.txt"
EMBEDDED_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
REPREPARE = "re-run `python -m fp8_lightning prepare` to rebuild the dataset"


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


def worker_start(num_workers: int, rank: int = 0) -> dict[str, Any]:
    """How loader workers start: from a forkserver, not forked from the trainer. A fork copies
    the trainer's threads' locks as they are: on Python before 3.12 a worker forked while another
    thread held the interpreter's runtime lock (the previous loader's queue threads exiting, at the
    sanity check -> training or an epoch boundary) hangs for ever in its start-up, and the run with
    it (python/cpython#112275). Python 3.14 makes forkserver the default. Windows (no forkserver)
    spawns."""
    if num_workers == 0 or "forkserver" not in multiprocessing.get_all_start_methods():
        return {}
    # the forkserver imports these once; each worker forks from it instead of importing torch
    multiprocessing.set_forkserver_preload(["torch", "litdata", __name__])
    return {"multiprocessing_context": "forkserver",
            "worker_init_fn": functools.partial(_end_with_the_trainer, rank=rank)}


def _end_with_the_trainer(worker_id: int, rank: int) -> None:
    """A forkserver's worker is the forkserver's child, so torch's watchdog (has my parent
    changed?) watches the forkserver, which lives as long as its workers: after a trainer killed
    mid-run they would live on. multiprocessing's parent sentinel is the trainer's: a thread
    ends the worker when it closes. Lightning seeds the worker as it would have (``seed_everything
    (workers=True)``; it adds its own ``worker_init_fn`` only where the loader has none)."""
    if os.environ.get("PL_SEED_WORKERS") == "1":
        from lightning.fabric.utilities.seed import pl_worker_init_function

        pl_worker_init_function(worker_id, rank=rank)
    trainer = multiprocessing.parent_process()
    if trainer is not None:
        threading.Thread(target=_exit_after, args=(trainer,), daemon=True,
                         name="fp8-lightning: end with the trainer").start()


def _exit_after(trainer: Any) -> None:
    trainer.join()
    os._exit(0)


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
            self._read_restored = False  # has an iteration read from the loaded state?

        def load_state_dict(self, obj: dict[str, Any]) -> None:
            super().load_state_dict(obj)
            self._read_restored = False

        def __iter__(self) -> Iterator[Any]:
            # litdata leaves `restore` set until an epoch's loop runs into StopIteration; Lightning
            # ends an epoch at its batch count without asking for one more, so after a mid-epoch
            # resume the epochs after the resumed one did not read what an uninterrupted run reads
            # (litdata took them as still restoring; as Lightning-AI/litData#760 with early breaks).
            # Once an iteration has read from the loaded state, the next one is a new epoch.
            if self.restore and self._read_restored:
                self.restore = False
            for batch in super().__iter__():
                self._read_restored = True
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
                                       **worker_start(self.num_workers, self._rank()),
                                       vocab_size=self._vocab_size(), where=f"data.data_dir="
                                       f"{self.dataset_dir!r} ({split} split)")

    def _rank(self) -> int:
        return self.trainer.global_rank if self.trainer is not None else 0

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
