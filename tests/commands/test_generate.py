import pytest
import torch

from fp8_lightning.checkpoint import CheckpointError
from fp8_lightning.commands.generate import generate
from fp8_lightning.config import ConfigError
from tests._runs import bytes_data, run_cli, small_vocab_fit


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


def test_generate_command(ckpt):
    result = run_cli("generate", "--ckpt", str(ckpt), "--prompt", "ROMEO:", "--max_new_tokens",
                     "12", "--temperature", "0", "--device", "cpu", "--backend", "torch")
    assert result.returncode == 0, result.stderr[-2000:]
    expected = generate(str(ckpt), prompt="ROMEO:", max_new_tokens=12, temperature=0)
    assert result.stdout == expected + "\n"


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


def test_generate_errors_are_one_clear_line(ckpt, tmp_path):
    result = run_cli("generate", "--ckpt", str(tmp_path / "missing.ckpt"), "--prompt", "hi")
    assert result.returncode == 2
    assert "error: checkpoint" in result.stderr and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr
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
