"""The streaming data module (``fp8_lightning/data/streaming.py``): blocks from litdata shards, the
embedded default corpus, checks of a dataset before training, and its resume state."""

import json
import struct

import pytest

from fp8_lightning.config import ConfigError
from fp8_lightning.data.streaming import TokenShardDataModule
from fp8_lightning.tokenizer import get_tokenizer


def test_data_state_mismatch_names_the_field():
    from fp8_lightning.config import ConfigError
    from fp8_lightning.data.streaming import TokenShardDataModule

    data = TokenShardDataModule(seq_len=64, batch_size=4)
    state = dict(TokenShardDataModule(seq_len=128, batch_size=4).state_dict(), seed=7)
    with pytest.raises(ConfigError, match=r"(?s)data.seq_len=64 but the checkpoint was trained "
                                          r"with 128 .*data.seed=42 but .* with 7"):
        data.load_state_dict(state)


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """The data module's default, the embedded corpus (blocks of 65 tokens), prepared into a cold
    cache between two seedings of the generators: (the module, the draws the seed gives, the
    draws it gives after that prepare)."""
    import random

    import numpy as np
    import torch

    def draws():
        return torch.rand(3).tolist(), random.random(), float(np.random.rand())

    dm = TokenShardDataModule(seq_len=64, batch_size=4, num_workers=0,
                              cache_dir=str(tmp_path_factory.mktemp("embedded-cache")))
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    expected = draws()
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    dm.prepare_data()
    return dm, expected, draws()


def test_datamodule_streams_blocks_from_the_embedded_corpus(embedded):
    dm = embedded[0]
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (4, 65)
    assert dm.meta["tokenizer"] == "gpt2" and dm.meta["vocab_size"] == 50257
    text = get_tokenizer("gpt2").decode(next(iter(dm.val_dataloader()))[0].tolist())
    assert len(text) > 100


def test_datamodule_rejects_bad_settings_and_missing_data(tmp_path):
    with pytest.raises(ConfigError, match="data.batch_size=3 x seq_len=100"):
        TokenShardDataModule(seq_len=100, batch_size=3)
    dm = TokenShardDataModule(data_dir=str(tmp_path / "none"), seq_len=64, batch_size=4)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        dm.setup("fit")
    (tmp_path / "empty").mkdir()
    dm = TokenShardDataModule(data_dir=str(tmp_path / "empty"), seq_len=64, batch_size=4)
    with pytest.raises(FileNotFoundError, match="is not a prepared dataset"):
        dm.setup("fit")


def test_preparing_the_embedded_corpus_leaves_the_seeded_generators_alone(embedded):
    """A cold cache must not change the weights a seed gives (the model is built after
    prepare_data), or an FP8 run and a BF16 run of the same seed start from different weights."""
    dm, expected, after_prepare = embedded
    assert (dm.cache_dir / "tinyshakespeare-gpt2-s64" / "meta.json").is_file()  # it did prepare
    assert after_prepare == expected


def test_datamodule_rejects_token_ids_outside_the_vocabulary(dataset):
    chunk = dataset / "train" / "chunk-0-0.bin"
    raw = bytearray(chunk.read_bytes())
    offset = 12 + 4 * 100  # token 100, after the chunk's 12-byte header of int32s
    raw[offset:offset + 4] = struct.pack("<i", 60000)
    chunk.write_bytes(bytes(raw))
    dm = TokenShardDataModule(data_dir=str(dataset), seq_len=16, batch_size=1, num_workers=1,
                              shuffle=False)
    dm.setup("fit")
    with pytest.raises(ConfigError) as err:
        for _ in dm.train_dataloader():
            pass
    assert "a batch holds token id 60000, outside the vocabulary (0..50256)" in str(err.value)
    assert f"data.data_dir={str(dataset)!r} (train split)" in str(err.value)
    assert "re-run `python -m fp8_lightning prepare`" in str(err.value)
    val = dataset / "val" / "chunk-0-0.bin"
    val.write_bytes(val.read_bytes()[:12] + b"\xff" * (val.stat().st_size - 12))  # garbage: -1
    with pytest.raises(ConfigError, match=r"\(val split\): a batch holds token id -1"):
        next(iter(dm.val_dataloader()))


def test_datamodule_rejects_a_truncated_or_missing_shard_and_a_broken_index(dataset):
    def setup_error():
        dm = TokenShardDataModule(data_dir=str(dataset), seq_len=16, batch_size=1, num_workers=1)
        with pytest.raises(ConfigError) as err:
            dm.setup("fit")
        assert f"data.data_dir={str(dataset)!r}" in str(err.value)
        assert "re-run `python -m fp8_lightning prepare`" in str(err.value)
        return str(err.value)

    chunk = dataset / "train" / "chunk-0-0.bin"
    good = chunk.read_bytes()
    chunk.write_bytes(good[:100])
    assert f"{chunk} has 100 bytes where index.json records {len(good)}" in setup_error()
    chunk.unlink()
    assert f"{chunk} is missing" in setup_error()
    chunk.write_bytes(good)
    index = dataset / "val" / "index.json"
    layout = json.loads(index.read_text())
    index.write_text(json.dumps(layout)[:-10])
    assert f"{index} is not valid JSON" in setup_error()
    index.write_text(json.dumps({**layout, "chunks": [{"filename": "chunk-0-0.bin"}]}))
    assert f"{index} is not a valid litdata index: chunk 0 has no 'chunk_bytes'" in setup_error()
    del layout["config"]
    index.write_text(json.dumps(layout))
    assert f"{index} is not a valid litdata index: no 'config' object" in setup_error()


def test_datamodule_refuses_a_split_smaller_than_one_micro_batch(dataset):
    # 39 train and 9 val blocks of 17 tokens
    dm = TokenShardDataModule(data_dir=str(dataset), seq_len=16, batch_size=16, num_workers=1)
    with pytest.raises(ConfigError) as err:
        dm.setup("fit")
    assert err.value.problems == [
        f"data.data_dir={str(dataset)!r}: the val split has 9 blocks of seq_len+1=17 tokens per "
        "rank (1 rank(s)), not one full micro-batch of data.batch_size=16 with data.num_workers=1 "
        "(val would run no batch); lower data.batch_size, data.num_workers or seq_len, or prepare "
        "more data"]
    dm = TokenShardDataModule(data_dir=str(dataset), seq_len=16, batch_size=48, num_workers=1)
    with pytest.raises(ConfigError) as err:
        dm.setup("fit")
    train, val = err.value.problems
    assert "the train split has 39 blocks" in train and "(train would run no step)" in train
    assert "the val split has 9 blocks" in val and "data.batch_size=48" in val
    dm = TokenShardDataModule(data_dir=str(dataset), seq_len=16, batch_size=9, num_workers=1)
    dm.setup("fit")  # one full batch of each: accepted
    assert sum(1 for _ in dm.val_dataloader()) == 1


def test_embedded_corpus_cache_is_keyed_by_the_tokenizers_content(tmp_path):
    """A tokenizer file or directory names its cache by content: two tokenizers with the same
    name never share one, a copy of the same tokenizer.json does."""
    def cache(tokenizer):
        return TokenShardDataModule(tokenizer=str(tokenizer), seq_len=64, batch_size=4,
                                    cache_dir=str(tmp_path / "cache")).dataset_dir

    for folder, vocab in (("one", "x"), ("two", "y"), ("three", "x")):
        (tmp_path / folder / "tok").mkdir(parents=True)
        (tmp_path / folder / "tok" / "tokenizer.json").write_text('{"model": {"vocab": {"%s": 0}}}' % vocab)
    one, two, three = (tmp_path / f / "tok" for f in ("one", "two", "three"))
    assert cache(one) != cache(two)  # same directory name, other tokenizer.json: two caches
    assert cache(one / "tokenizer.json") != cache(two / "tokenizer.json")
    assert cache(one) == cache(three)  # the same tokenizer.json elsewhere: the same cache
    assert cache("gpt2").endswith("tinyshakespeare-gpt2-s64")


def test_loader_workers_start_from_a_forkserver_not_a_fork_of_the_trainer(dataset):
    """A worker forked while another thread of the trainer held the interpreter's runtime lock
    hangs in its start-up on Python < 3.12 (python/cpython#112275; seen as a two-rank CPU fit whose
    rank 1 waited for ever on its first batch): workers start from a forkserver and stream as
    before. (That they end with a killed trainer: tests/test_signals.py.)"""
    dm = TokenShardDataModule(data_dir=str(dataset), seq_len=16, batch_size=2, num_workers=1,
                              shuffle=False)
    dm.setup("fit")
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        assert loader.multiprocessing_context.get_start_method() == "forkserver"
        assert next(iter(loader)).shape == (2, 17)
    no_workers = TokenShardDataModule(data_dir=str(dataset), seq_len=16, batch_size=2,
                                      num_workers=0, shuffle=False)
    no_workers.setup("fit")
    assert no_workers.train_dataloader().multiprocessing_context is None
