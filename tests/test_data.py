import json
import multiprocessing
import os
import shutil
import struct

import pytest

from fp8_lightning.data import prepare as prepare_module
from fp8_lightning.cli import main
from fp8_lightning.config import ConfigError
from fp8_lightning.data.prepare import prepare
from fp8_lightning.data.streaming import TokenShardDataModule
from fp8_lightning.tokenizer import get_tokenizer

TEXT_A = "To be, or not to be, that is the question:\n" * 60
TEXT_B = "Whether 'tis nobler in the mind to suffer\n" * 60


def read_split(root, split, block):
    from litdata import StreamingDataset
    from litdata.streaming.item_loader import TokensLoader

    ds = StreamingDataset(str(root / split), item_loader=TokensLoader(block_size=block))
    return [int(t) for i in range(len(ds)) for t in ds[i]]


def snapshot(root):
    """Every file under ``root`` with its bytes: a dataset must come out of a failure unchanged."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A tiny prepared dataset (39 train / 9 val blocks of 17 tokens); tests read it or corrupt
    copies."""
    root = tmp_path_factory.mktemp("prepared")
    (root / "a.txt").write_text(TEXT_A)
    prepare([str(root / "a.txt")], str(root / "ds"), seq_len=16, val_fraction=0.2, num_workers=1)
    return root / "ds"


@pytest.fixture
def dataset(prepared, tmp_path):
    shutil.copytree(prepared, tmp_path / "ds")
    return tmp_path / "ds"


def test_prepare_round_trip_decodes_to_the_source_text(prepared):
    meta = json.loads((prepared / "meta.json").read_text())  # TEXT_A, seq_len=16, val_fraction=0.2
    tok = get_tokenizer("gpt2")
    ids = tok.encode(TEXT_A) + [tok.eot_id]
    assert meta["train_tokens"] + meta["val_tokens"] == len(ids)
    assert meta["documents"] == 1 and meta["vocab_size"] == 50257
    # Blocks of seq_len+1 tokens: the streamed tokens are the source's, in order, up to the
    # partial last block of each split.
    train, val = read_split(prepared, "train", 17), read_split(prepared, "val", 17)
    cut = meta["train_tokens"]
    assert train == ids[: len(train)] and len(train) == cut // 17 * 17
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
    before = multiprocessing.get_start_method()
    runs = [prepare([str(tmp_path / "part*.txt")], str(tmp_path / f"ds{r}"), seq_len=15,
                    val_fraction=0.1, num_workers=2) for r in range(2)]
    assert runs[0]["num_workers"] == 2
    # litdata's optimize forces the process-wide start method to spawn; prepare puts it back, or
    # every later data loader of the process would spawn (re-import torch) at each epoch
    assert multiprocessing.get_start_method() == before
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
    with pytest.raises(ConfigError, match="bad.jsonl:1: no field 'text'"):
        prepare([str(bad)], str(tmp_path / "o"), seq_len=15)
    with pytest.raises(ConfigError, match="val_fraction=1.5"):
        prepare([str(bad)], str(tmp_path / "o"), val_fraction=1.5)
    with pytest.raises(ConfigError, match="num_workers=-2 must be a positive integer"):
        prepare([str(bad)], str(tmp_path / "o"), num_workers=-2)


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


# ---------------------------------------------------------------- bad input: one clear error

def test_prepare_reports_every_bad_input_file_before_writing(tmp_path):
    ok = tmp_path / "ok.txt"
    ok.write_text(TEXT_A)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n\n{"text": "unterminated}\n')
    (tmp_path / "field.jsonl").write_text('{"body": "x", "id": 1}\n')
    (tmp_path / "number.jsonl").write_text('{"text": "x"}\n{"text": 42}\n')
    with pytest.raises(ConfigError) as err:
        prepare([str(tmp_path / "*")], str(tmp_path / "out"), seq_len=16)
    problems = err.value.problems
    assert len(problems) == 5, problems  # one per bad file, ok.txt passes
    by_file = {os.path.basename(p.split(":")[1]): p for p in problems}
    assert "not UTF-8" in by_file["latin1.txt"] and "offset 3" in by_file["latin1.txt"]
    assert "convert the file to UTF-8" in by_file["latin1.txt"]
    # line 2 starts at byte 15; its bad byte is 13 bytes further
    assert "latin1.jsonl:2: not UTF-8" in by_file["latin1.jsonl"]
    assert "offset 28" in by_file["latin1.jsonl"]
    assert "broken.jsonl:3: not valid JSON" in by_file["broken.jsonl"]
    assert "field.jsonl:1: no field 'text' (it has 'body', 'id')" in by_file["field.jsonl"]
    assert "number.jsonl:2: field 'text' is a JSON int, not a string" in by_file["number.jsonl"]
    assert not (tmp_path / "out").exists()


def test_prepare_rejects_a_bad_tokenizer(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT_A)
    broken = tmp_path / "broken.json"
    broken.write_text('{"model": ')
    for tokenizer, expected in ((str(tmp_path / "none.json"), "no such file"),
                                (str(tmp_path), "no such file"),  # a directory without one
                                (str(tmp_path / "a.txt"), "is not a .json file"),
                                (str(broken), "is not a valid Hugging Face tokenizer.json")):
        with pytest.raises(ConfigError, match="tokenizer=") as err:
            prepare([str(tmp_path / "a.txt")], str(tmp_path / "out"), tokenizer=tokenizer)
        assert expected in str(err.value) and "'gpt2'" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_prepare_refuses_an_output_dir_it_cannot_write_or_would_damage(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text(TEXT_A)
    with pytest.raises(ConfigError, match="output_dir=.*a.txt' is an existing file"):
        prepare([str(tmp_path / "a.txt")], str(tmp_path / "a.txt"))
    assert (tmp_path / "a.txt").read_text() == TEXT_A
    # prepare replaces the whole directory: one holding anything else (here, the input) is not
    # a dataset to replace
    with pytest.raises(ConfigError, match="not a prepared dataset .it holds a.txt.*choose a new"):
        prepare([str(tmp_path / "a.txt")], str(tmp_path))
    readonly = tmp_path / "ro"
    readonly.mkdir()
    if os.geteuid() == 0:  # root writes anywhere: make the write probe fail as the OS would
        real = prepare_module.tempfile.TemporaryFile

        def refuse(*args, dir=None, **kwargs):
            if dir is not None and str(dir).startswith(str(readonly)):
                raise PermissionError(13, "Permission denied")
            return real(*args, dir=dir, **kwargs)
        monkeypatch.setattr(prepare_module.tempfile, "TemporaryFile", refuse)
    readonly.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match=r"cannot write in .*ro \(Permission denied\)"):
            prepare([str(tmp_path / "a.txt")], str(readonly / "sub" / "ds"))
    finally:
        readonly.chmod(0o755)
    assert list(readonly.iterdir()) == []


def test_prepare_refuses_a_corpus_too_small_for_a_block_before_writing(tmp_path, dataset):
    before = snapshot(dataset)
    (tmp_path / "small.txt").write_text("To be, or not to be, that is the question:\n" * 3)
    with pytest.raises(ConfigError) as err:  # 43 tokens: 35 train, 8 val at val_fraction=0.2
        prepare([str(tmp_path / "small.txt")], str(dataset), seq_len=16, val_fraction=0.2)
    assert err.value.problems == [
        "the val split would have 8 tokens (val_fraction=0.2 of every file), fewer than one block "
        "of seq_len+1=17: lower seq_len, raise val_fraction or add data"]
    with pytest.raises(ConfigError) as err:
        prepare([str(tmp_path / "small.txt")], str(dataset), seq_len=48, val_fraction=0.2)
    assert len(err.value.problems) == 2
    assert err.value.problems[0].startswith("the train split would have 35 tokens, fewer than one "
                                            "block of seq_len+1=49: lower seq_len, lower val_fraction")
    assert snapshot(dataset) == before


def test_a_prepare_that_fails_midway_leaves_the_existing_dataset_untouched(tmp_path, dataset,
                                                                            monkeypatch):
    import litdata

    before = snapshot(dataset)
    (tmp_path / "b.txt").write_text(TEXT_B)

    def crash(*args, output_dir, **kwargs):  # a worker dies after writing part of a split
        os.makedirs(output_dir)
        (prepare_module.Path(output_dir) / "chunk-0-0.bin").write_bytes(b"partial")
        raise RuntimeError("worker died")
    monkeypatch.setattr(litdata, "optimize", crash)
    with pytest.raises(RuntimeError, match="worker died"):
        prepare([str(tmp_path / "b.txt")], str(dataset), seq_len=16, val_fraction=0.2)
    assert snapshot(dataset) == before
    assert sorted(p.name for p in dataset.parent.iterdir()) == ["b.txt", "ds"]  # no leftovers
    monkeypatch.undo()
    meta = prepare([str(tmp_path / "b.txt")], str(dataset), seq_len=16, val_fraction=0.2,
                   num_workers=1)
    assert meta["files"] == [str(tmp_path / "b.txt")]  # replaced once complete
    assert json.loads((dataset / "meta.json").read_text()) == meta
    assert sorted(p.name for p in dataset.parent.iterdir()) == ["b.txt", "ds"]


def assert_one_error_line(capsys, *needles):
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in err, err


def test_prepare_command_prints_one_error_and_exits_2(tmp_path, capsys, dataset):
    before = snapshot(dataset)
    (tmp_path / "latin1.txt").write_bytes(b"na\xefve")
    with pytest.raises(SystemExit) as exit_:
        main(["prepare", "--inputs", str(tmp_path / "latin1.txt"), "--output_dir", str(dataset)])
    assert exit_.value.code == 2
    assert_one_error_line(capsys, "latin1.txt: not UTF-8 text (invalid byte at offset 2")
    (tmp_path / "small.txt").write_text("Hello there.\n")
    with pytest.raises(SystemExit) as exit_:
        main(["prepare", "--inputs", str(tmp_path / "small.txt"), "--output_dir", str(dataset),
              "--seq_len", "16"])
    assert exit_.value.code == 2
    assert_one_error_line(capsys, "the train split would have", "the val split would have")
    with pytest.raises(SystemExit) as exit_:
        main(["prepare", "--inputs", str(tmp_path / "small.txt"), "--output_dir", str(dataset),
              "--tokenizer", str(tmp_path / "tok.json")])
    assert exit_.value.code == 2
    assert_one_error_line(capsys, "tokenizer=", "no such file")
    assert snapshot(dataset) == before


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
