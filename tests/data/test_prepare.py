"""``prepare`` (``fp8_lightning/data/prepare.py``): text and JSONL to tokenized litdata shards,
reproducible across workers, and every bad input one error before anything is written."""

import json
import multiprocessing
import os
import re

import pytest

from fp8_lightning.config import ConfigError
from fp8_lightning.data import prepare as prepare_module
from fp8_lightning.data.prepare import prepare
from fp8_lightning.tokenizer import get_tokenizer
from tests._runs import cli_error, two_worker_prepare
from tests.data import PARTS, TEXT_A, TEXT_B
from tests.helpers import DURATION


def read_split(root, split, block):
    from litdata import StreamingDataset
    from litdata.streaming.item_loader import TokensLoader

    ds = StreamingDataset(str(root / split), item_loader=TokensLoader(block_size=block))
    return [int(t) for i in range(len(ds)) for t in ds[i]]


def snapshot(root):
    """Every file under ``root`` with its bytes: a dataset must come out of a failure unchanged."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


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


def test_prepare_with_several_workers_is_reproducible_and_keeps_file_order(tmp_path_factory,
                                                                           tmp_path):
    # litdata's default work queue hands files to whichever worker is free, and the chunk names say
    # which worker wrote them: the same inputs gave a differently ordered dataset on every run.
    # Two runs of the same six files (PARTS) with two workers: the CLI's, which the console test
    # shares, and this process's.
    tok = get_tokenizer("gpt2")
    inputs, _ = two_worker_prepare(tmp_path_factory)
    ds0, ds1 = inputs / "ds", tmp_path / "ds1"
    before = multiprocessing.get_start_method()
    meta = prepare([str(inputs / "part*.txt")], str(ds1), seq_len=15, val_fraction=0.1,
                   num_workers=2)
    assert meta["num_workers"] == 2
    # litdata's optimize forces the process-wide start method to spawn; prepare puts it back, or
    # every later data loader of the process would spawn (re-import torch) at each epoch
    assert multiprocessing.get_start_method() == before
    for split in ("train", "val"):
        files = sorted(p.relative_to(ds0) for p in (ds0 / split).iterdir())
        assert files == sorted(p.relative_to(ds1) for p in (ds1 / split).iterdir())
        for name in files:
            a, b = ((ds / name).read_bytes() for ds in (ds0, ds1))
            if name.name == "index.json":  # the same chunks, in the same order; a write time differs
                a, b = ({**json.loads(x), "updated_at": None} for x in (a, b))
            assert a == b, name
    # Worker 0 takes the first half of the sorted files, worker 1 the second: the stream starts
    # with part0's tokens and the second worker's chunks start with part3's.
    train = read_split(ds0, "train", 16)
    first = tok.encode(PARTS[0]) + [tok.eot_id]
    assert train[:64] == first[:64]
    fourth = tok.encode(PARTS[3]) + [tok.eot_id]
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


def test_prepare_command_prints_one_error_and_exits_2(tmp_path, capsys, dataset):
    before = snapshot(dataset)
    (tmp_path / "latin1.txt").write_bytes(b"na\xefve")
    message = cli_error(capsys, "prepare", "--inputs", str(tmp_path / "latin1.txt"),
                        "--output_dir", str(dataset))
    assert "latin1.txt: not UTF-8 text (invalid byte at offset 2" in message, message
    (tmp_path / "small.txt").write_text("Hello there.\n")
    message = cli_error(capsys, "prepare", "--inputs", str(tmp_path / "small.txt"),
                        "--output_dir", str(dataset), "--seq_len", "16")
    assert "the train split would have" in message and "the val split would have" in message
    message = cli_error(capsys, "prepare", "--inputs", str(tmp_path / "small.txt"),
                        "--output_dir", str(dataset), "--tokenizer", str(tmp_path / "tok.json"))
    assert "tokenizer=" in message and "no such file" in message, message
    assert snapshot(dataset) == before


def test_prepare_prints_progress_lines_with_the_bytes_done_of_the_total(tmp_path, monkeypatch):
    from fp8_lightning import progress
    from fp8_lightning.checkpoint_files import human_size

    for name, text in (("a.txt", TEXT_A), ("b.txt", TEXT_B)):
        (tmp_path / name).write_text(text)
    total = human_size((tmp_path / "a.txt").stat().st_size + (tmp_path / "b.txt").stat().st_size)
    lines = []
    monkeypatch.setattr(prepare_module, "rank_zero_info", lines.append)
    monkeypatch.setattr(progress, "EVERY_S", 0.05)  # a line every 50 ms: the run takes seconds
    prepare([str(tmp_path / "*.txt")], str(tmp_path / "ds"), seq_len=16, val_fraction=0.2,
            num_workers=1)
    for split in ("train", "val"):
        mine = [line for line in lines if line.startswith(f"prepare: tokenizing {split}: ")]
        assert mine, lines
        assert all(re.fullmatch(rf"prepare: tokenizing {split}: [\d.]+ K?B of {total} \(\d+%\), "
                                rf"{DURATION} so far(, about {DURATION} left|, finishing)?", line)
                   for line in mine), mine
        shares = [int(re.search(r"\((\d+)%\)", line)[1]) for line in mine]
        assert shares == sorted(shares) and shares[-1] == 100, mine  # done grows to the total
    # The workers' record of finished files is not part of the dataset.
    assert sorted(os.listdir(tmp_path / "ds")) == ["meta.json", "train", "val"]
