import shutil

import pytest
import torch

from fp8_lightning.checkpoint_files import CheckpointError
from fp8_lightning.commands.generate import generate
from fp8_lightning.config import ConfigError, GPTConfig
from fp8_lightning.model import GPT
from tests._runs import BYTES_VOCAB, byte_tokenizer, bytes_data, one_error_line, run_cli, \
    run_main, small_vocab_fit


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """last.ckpt of the session's quickstart fit, trained on a small vocabulary: its own
    tokenizer.json, not GPT-2's."""
    out, _ = small_vocab_fit(tmp_path_factory)
    (path,) = out.rglob("last.ckpt")
    return path


def test_generate_python_api(ckpt):
    greedy = generate(str(ckpt), prompt="ROMEO:", max_new_tokens=12, temperature=0, device="cpu")
    assert greedy.startswith("ROMEO:") and len(greedy) > len("ROMEO:")
    assert generate(str(ckpt), prompt="ROMEO:", max_new_tokens=12, temperature=0) == greedy
    a = generate(str(ckpt), prompt="ROMEO:", max_new_tokens=12, temperature=1.0, top_k=50, seed=1)
    b = generate(str(ckpt), prompt="ROMEO:", max_new_tokens=12, temperature=1.0, top_k=50, seed=1)
    assert a == b  # seeded
    assert generate(str(ckpt), prompt="", max_new_tokens=4, backend="torch")  # from end-of-text


def test_generate_command(ckpt, capsys):
    """(In this process: the command's output is under test, not Python's start-up.)"""
    code, out, err = run_main(capsys, ["generate", "--ckpt", ckpt, "--prompt", "ROMEO:",
                                       "--max_new_tokens", "12", "--temperature", "0", "--device",
                                       "cpu", "--backend", "torch"])
    assert code == 0, err[-2000:]
    expected = generate(str(ckpt), prompt="ROMEO:", max_new_tokens=12, temperature=0)
    assert out == expected + "\n"


def test_generate_loads_a_checkpoint_with_te_extra_state(ckpt, tmp_path):
    """A TE checkpoint carries `_extra_state` blobs (pickled FP8 scaling state): they are
    dropped, every weight must still load strictly."""
    checkpoint = torch.load(ckpt, weights_only=True)
    extra = [k for k in checkpoint["state_dict"] if k.endswith("_extra_state")]
    assert extra
    for key in extra:
        checkpoint["state_dict"][key] = torch.randint(0, 255, (64,), dtype=torch.uint8)
    path = tmp_path / "te.ckpt"
    torch.save(checkpoint, path)
    assert generate(str(path), prompt="ROMEO:", max_new_tokens=4, temperature=0) == \
        generate(str(ckpt), prompt="ROMEO:", max_new_tokens=4, temperature=0)
    # ... but a missing weight is an error, not silently random
    del checkpoint["state_dict"]["model.blocks.0.proj.weight"]
    torch.save(checkpoint, path)
    with pytest.raises(ConfigError, match="blocks.0.proj.weight"):
        generate(str(path), prompt="x", max_new_tokens=1)


def test_generate_errors_are_one_clear_line(ckpt, tmp_path, capsys):
    code, _, err = run_main(capsys, ["generate", "--ckpt", tmp_path / "missing.ckpt", "--prompt",
                                     "hi"])
    assert code == 2
    assert "error: checkpoint" in err and "does not exist" in err
    assert "Traceback" not in err
    broken = tmp_path / "broken.ckpt"
    broken.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="broken.ckpt' is not a checkpoint written by torch.save"):
        generate(str(broken))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="backend='te' needs TransformerEngine on a GPU"):
            generate(str(ckpt), backend="te")
    with pytest.raises(ConfigError, match="temperature=-1"):
        generate(str(ckpt), temperature=-1)


def test_generate_decodes_with_the_tokenizer_the_checkpoint_was_trained_with(ckpt, tmp_path,
                                                                            tmp_path_factory):
    """The checkpoint records the training data's tokenizer and generate uses it: a checkpoint
    trained with another tokenizer is never decoded as GPT-2 BPE (garbage with exit 0)."""
    trained_with = str((bytes_data(tmp_path_factory) / "tokenizer.json").resolve())
    checkpoint = torch.load(ckpt, weights_only=True)
    assert checkpoint["fp8_lightning"]["tokenizer"] == trained_with  # the dataset's
    checkpoint["fp8_lightning"]["tokenizer"] = str(tmp_path / "llama" / "tokenizer.json")
    other = tmp_path / "other.ckpt"
    torch.save(checkpoint, other)
    with pytest.raises(ConfigError, match="(?s)trained with tokenizer .*llama/tokenizer.json.*--tokenizer"):
        generate(str(other), prompt="ROMEO:", max_new_tokens=2)
    # --tokenizer overrides what the checkpoint records
    assert generate(str(other), prompt="ROMEO:", max_new_tokens=2,
                    tokenizer=trained_with).startswith("ROMEO:")


# A user's `--tokenizer` against the one the checkpoint records: small checkpoints of an untrained
# `tiny` model on the 257-token byte vocabulary, written as fit writes them (no fit to wait for).

def tiny_checkpoint(path, tokenizer=None):
    """A checkpoint of a `tiny` model on the byte vocabulary whose data was prepared with
    ``tokenizer`` (None: a checkpoint that records none)."""
    config = GPTConfig(name="tiny", vocab_size=BYTES_VOCAB)
    torch.manual_seed(0)
    state = {f"model.{k}": v for k, v in GPT(config, backend="torch").state_dict().items()}
    meta = {"config": config.to_dict(), "precision": "bf16", "val_loss": None, "val_step": None}
    if tokenizer is not None:
        meta["tokenizer"] = str(tokenizer)
    torch.save({"state_dict": state, "pytorch-lightning_version": "2.6.0", "global_step": 0,
                "tokens_seen": 0, "hyper_parameters": {"config": config.to_dict()},
                "fp8_lightning": meta}, path)
    return path


def scrambled_byte_tokenizer(path):
    """As many tokens as the byte tokenizer, but other bytes behind the ids: a model trained with
    one prints garbage through the other, and only the files' content tells them apart."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), reverse=True)
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


@pytest.fixture
def trained(tmp_path):
    """(checkpoint, the tokenizer.json it was trained with, another one of the same size)."""
    bytes_json = byte_tokenizer(tmp_path / "bytes.json")
    return (tiny_checkpoint(tmp_path / "tiny.ckpt", bytes_json), bytes_json,
            scrambled_byte_tokenizer(tmp_path / "scrambled" / "tokenizer.json"))


def test_generate_refuses_a_tokenizer_other_than_the_checkpoints(trained, capsys):
    """`--tokenizer gpt2` for a checkpoint trained with another vocabulary printed garbage and
    exited 0: it is one error line naming both tokenizers and what to pass, exit status 2."""
    ckpt, bytes_json, scrambled = trained
    line = one_error_line(capsys, ["generate", "--ckpt", ckpt, "--tokenizer", "gpt2",
                                   "--device", "cpu"])
    assert line == (f"error: invalid generate: --tokenizer 'gpt2' is not the tokenizer this "
                    f"checkpoint was trained with, '{bytes_json}' (its text would decode as "
                    f"garbage); pass --tokenizer {bytes_json} or leave --tokenizer out, or add "
                    "--force_tokenizer true to decode with 'gpt2' anyway")
    # the same number of tokens is no excuse: the content differs
    line = one_error_line(capsys, ["generate", "--ckpt", ckpt, "--tokenizer", scrambled])
    assert f"--tokenizer '{scrambled}' is not the tokenizer this checkpoint" in line
    with pytest.raises(ConfigError, match="--force_tokenizer true"):  # the Python API too
        generate(str(ckpt), prompt="ROMEO:", max_new_tokens=2, tokenizer=str(scrambled))


def test_generate_accepts_the_checkpoints_tokenizer_by_content_wherever_it_lies(trained, tmp_path):
    ckpt, bytes_json, _ = trained
    default = generate(str(ckpt), prompt="ROMEO:", max_new_tokens=8, temperature=0)
    copy = tmp_path / "elsewhere" / "tokenizer.json"
    copy.parent.mkdir()
    shutil.copy(bytes_json, copy)
    for passed in (bytes_json, copy):
        assert generate(str(ckpt), prompt="ROMEO:", max_new_tokens=8, temperature=0,
                        tokenizer=str(passed)) == default


def test_force_tokenizer_decodes_with_the_one_passed_and_warns_once(trained, caplog):
    ckpt, bytes_json, scrambled = trained
    args = ["generate", "--ckpt", str(ckpt), "--prompt", "ROMEO:", "--max_new_tokens", "8",
            "--temperature", "0", "--device", "cpu", "--backend", "torch"]
    result = run_cli(*args, "--tokenizer", str(scrambled), "--force_tokenizer", "true")
    assert result.returncode == 0, result.stderr[-2000:]
    forced = generate(str(ckpt), prompt="ROMEO:", max_new_tokens=8, temperature=0,
                      tokenizer=str(scrambled), force_tokenizer=True)
    assert result.stdout == forced + "\n"
    assert forced != generate(str(ckpt), prompt="ROMEO:", max_new_tokens=8, temperature=0)
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and warnings[0].endswith(
        f"decoding with --tokenizer '{scrambled}' because of --force_tokenizer, though the "
        f"checkpoint was trained with '{bytes_json}': expect garbage"), result.stderr
    # forcing the checkpoint's own tokenizer changes nothing and warns of nothing
    caplog.clear()
    same = generate(str(ckpt), prompt="ROMEO:", max_new_tokens=8, temperature=0,
                    tokenizer=str(bytes_json), force_tokenizer=True)
    assert same == generate(str(ckpt), prompt="ROMEO:", max_new_tokens=8, temperature=0)
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text


def test_generate_with_no_recorded_tokenizer_uses_the_one_passed(tmp_path, trained):
    """A checkpoint that records no tokenizer (an older version's): nothing to compare with."""
    _, _, scrambled = trained
    ckpt = tiny_checkpoint(tmp_path / "unrecorded.ckpt")
    assert generate(str(ckpt), prompt="ROMEO:", max_new_tokens=4, temperature=0,
                    tokenizer=str(scrambled)).startswith("ROMEO:")


def test_generate_refuses_a_tokenizer_larger_than_the_model_when_the_recorded_one_is_not_here(
        tmp_path, trained, capsys):
    """Trained elsewhere: the recorded tokenizer's files are not on this machine, so only a
    vocabulary larger than the model's says the tokenizer passed is not that one."""
    _, bytes_json, _ = trained
    ckpt = tiny_checkpoint(tmp_path / "moved.ckpt", "/elsewhere/char/tokenizer.json")
    line = one_error_line(capsys, ["generate", "--ckpt", ckpt, "--tokenizer", "gpt2"])
    assert line == ("error: invalid generate: --tokenizer 'gpt2' is not the tokenizer this "
                    "checkpoint was trained with, '/elsewhere/char/tokenizer.json' (its 50,257 "
                    "tokens are more than the model's vocab_size=257); pass --tokenizer PATH to "
                    "a copy of '/elsewhere/char/tokenizer.json', which is not here, or add "
                    "--force_tokenizer true to decode with 'gpt2' anyway")
    assert generate(str(ckpt), prompt="ROMEO:", max_new_tokens=2,
                    tokenizer=str(bytes_json)).startswith("ROMEO:")  # a copy: it fits


def test_generate_draws_only_ids_its_tokenizer_decodes(tmp_path):
    """A head larger than the tokenizer's vocabulary (a Llama-sized model trained on GPT-2
    tokens): the continuation has only ids GPT-2 decodes."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(name="tiny", vocab_size=50400))
    with torch.no_grad():  # ids past GPT-2's 50,257 would win every greedy draw
        model.norm_f.bias.fill_(1.0)
        model.lm_head.weight[50257:] = 10.0
    config = model.config.to_dict()
    path = tmp_path / "big-head.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "pytorch-lightning_version": "2.6.6", "global_step": 0,
                "hyper_parameters": {"config": config},
                "fp8_lightning": {"config": config, "precision": "bf16", "tokenizer": "gpt2"}}, path)
    text = generate(str(path), prompt="The", max_new_tokens=4, temperature=0, device="cpu")
    assert text.startswith("The") and len(text) > len("The")
