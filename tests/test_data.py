import json

import pytest

from fp8_lightning.config import ConfigError
from fp8_lightning.data import TokenShardDataModule, prepare
from fp8_lightning.tokenizer import get_tokenizer

TEXT_A = "To be, or not to be, that is the question:\n" * 60
TEXT_B = "Whether 'tis nobler in the mind to suffer\n" * 60


def read_split(root, split, block):
    from litdata import StreamingDataset
    from litdata.streaming.item_loader import TokensLoader

    ds = StreamingDataset(str(root / split), item_loader=TokensLoader(block_size=block))
    return [int(t) for i in range(len(ds)) for t in ds[i]]


def test_prepare_round_trip_decodes_to_the_source_text(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text(TEXT_A)
    meta = prepare([str(src)], str(tmp_path / "ds"), seq_len=15, val_fraction=0.2, num_workers=1)
    tok = get_tokenizer("gpt2")
    ids = tok.encode(TEXT_A) + [tok.eot_id]
    assert meta["train_tokens"] + meta["val_tokens"] == len(ids)
    assert meta["documents"] == 1 and meta["vocab_size"] == 50257
    # Blocks of seq_len+1 tokens: the streamed tokens are the source's, in order, up to the
    # partial last block of each split.
    train, val = read_split(tmp_path / "ds", "train", 16), read_split(tmp_path / "ds", "val", 16)
    cut = meta["train_tokens"]
    assert train == ids[: len(train)] and len(train) == cut // 16 * 16
    assert val == ids[cut: cut + len(val)]
    assert TEXT_A.startswith(tok.decode(train))


def test_prepare_jsonl_puts_eot_between_documents(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"body": t}) for t in (TEXT_A, TEXT_B)) + "\n")
    meta = prepare([str(tmp_path / "*.jsonl")], str(tmp_path / "ds"), text_field="body",
                   seq_len=15, val_fraction=0.1, num_workers=1)
    tok = get_tokenizer("gpt2")
    ids = tok.encode(TEXT_A) + [tok.eot_id] + tok.encode(TEXT_B) + [tok.eot_id]
    assert meta["documents"] == 2
    assert read_split(tmp_path / "ds", "train", 16) == ids[: meta["train_tokens"] // 16 * 16]


def test_prepare_with_several_workers_is_reproducible_and_keeps_file_order(tmp_path):
    # litdata's default work queue hands files to whichever worker is free, and the chunk names say
    # which worker wrote them: the same inputs gave a differently ordered dataset on every run.
    tok = get_tokenizer("gpt2")
    lines = [TEXT_A, TEXT_B, "Ay, there's the rub;\n" * 90, "For in that sleep of death\n" * 30,
             "Must give us pause\n" * 120, "The slings and arrows\n" * 45]
    for i, text in enumerate(lines):  # different sizes: a size-sorted schedule would reorder them
        (tmp_path / f"part{i}.txt").write_text(text)
    runs = [prepare([str(tmp_path / "part*.txt")], str(tmp_path / f"ds{r}"), seq_len=15,
                    val_fraction=0.1, num_workers=2) for r in range(2)]
    assert runs[0]["num_workers"] == 2
    for split in ("train", "val"):
        files = sorted(p.relative_to(tmp_path / "ds0") for p in (tmp_path / "ds0" / split).iterdir())
        assert files == sorted(p.relative_to(tmp_path / "ds1") for p in (tmp_path / "ds1" / split).iterdir())
        for name in files:
            a, b = ((tmp_path / ds / name).read_bytes() for ds in ("ds0", "ds1"))
            if name.name == "index.json":  # the same chunks, in the same order; a write time differs
                a, b = ({**json.loads(x), "updated_at": None} for x in (a, b))
            assert a == b, name
    # Worker 0 takes the first half of the sorted files, worker 1 the second: the stream starts
    # with part0's tokens and the second worker's chunks start with part3's.
    train = read_split(tmp_path / "ds0", "train", 16)
    first = tok.encode(lines[0]) + [tok.eot_id]
    assert train[:64] == first[:64]
    fourth = tok.encode(lines[3]) + [tok.eot_id]
    assert any(train[i:i + 64] == fourth[:64] for i in range(0, len(train), 16))


def test_prepare_bad_inputs_are_one_clear_error(tmp_path):
    with pytest.raises(ConfigError) as err:
        prepare([str(tmp_path / "missing*.txt"), str(tmp_path / "nope.txt")], str(tmp_path / "o"))
    assert "matches no file" in str(err.value) and len(err.value.problems) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: no field 'text'"):
        prepare([str(bad)], str(tmp_path / "o"), seq_len=15)
    with pytest.raises(ConfigError, match="val_fraction=1.5"):
        prepare([str(bad)], str(tmp_path / "o"), val_fraction=1.5)
    with pytest.raises(ConfigError, match="num_workers=-2 must be a positive integer"):
        prepare([str(bad)], str(tmp_path / "o"), num_workers=-2)


def test_datamodule_streams_blocks_from_the_embedded_corpus():
    dm = TokenShardDataModule(seq_len=64, batch_size=4, num_workers=0)
    dm.prepare_data()
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


def test_preparing_the_embedded_corpus_leaves_the_seeded_generators_alone(tmp_path):
    """A cold cache must not change the weights a seed gives (the model is built after
    prepare_data), or an FP8 run and a BF16 run of the same seed start from different weights."""
    import random

    import numpy as np
    import torch

    def draws():
        return torch.rand(3).tolist(), random.random(), float(np.random.rand())

    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    expected = draws()
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    TokenShardDataModule(seq_len=64, batch_size=4, cache_dir=str(tmp_path)).prepare_data()
    assert (tmp_path / "tinyshakespeare-gpt2-s64" / "meta.json").is_file()  # it did prepare
    assert draws() == expected
