"""Hugging Face weights in and out (``hf.py``: loading, ``model.init_from``), against
``transformers`` itself on tiny GPT-2 and Llama models (tests/_hf.py); the ``convert`` command's
tests are in tests/commands/test_convert.py."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from fp8_lightning.config import ConfigError, GPTConfig
from fp8_lightning.fp8 import FP8Precision
from fp8_lightning.hf import load_hf, load_into
from fp8_lightning.model import GPT
from fp8_lightning.module import GPTLightningModule
from tests._hf import TINY, hf_dirs, transformers  # noqa: F401 - the fixture; skips without transformers
from tests._runs import one_error_line, run_main


@pytest.mark.parametrize("arch", TINY)
def test_weights_in_give_transformers_logits(hf_dirs, arch):
    directory, reference = hf_dirs[arch]
    config, state = load_hf(directory)
    assert config.vocab_size == reference.config.vocab_size
    assert config.padded_vocab_size % 128 == 0 and config.padded_vocab_size > config.vocab_size
    model = GPT(config, backend="torch").eval()
    load_into(model, state, str(directory))
    idx = torch.randint(0, config.vocab_size, (2, 24))
    with torch.no_grad():
        ours, theirs = model(idx), reference(idx).logits
    assert ours.shape == theirs.shape  # padded rows sliced off
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    # the padded rows are zeros in both embedding and head: they take no probability mass
    assert model.lm_head.weight[config.vocab_size:].abs().sum() == 0




def test_fine_tune_from_hf_under_the_fp8_plugin(hf_dirs, tmp_path):
    directory, reference = hf_dirs["llama"]
    module = GPTLightningModule(init_from=str(directory), backend="torch", warmup_steps=1)
    assert module.config.n_kv_heads == 2 and module.config.vocab_size == 1000
    module.configure_model()
    idx = torch.randint(0, 1000, (2, 16))
    with torch.no_grad():  # the weights are the directory's before any step
        torch.testing.assert_close(module.model(idx), reference(idx).logits, atol=1e-4, rtol=0)
    data = torch.randint(0, 1000, (8, 17))
    trainer = L.Trainer(max_steps=4, accelerator="cpu", plugins=[FP8Precision()], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=tmp_path)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    assert trainer.global_step == 4 and not trainer.precision_plugin.fp8_active  # CPU: fallback
    assert trainer.precision_plugin.reason  # ... with the reason
    assert not torch.equal(module.model.wte.weight[:1000].cpu(),
                           load_hf(directory)[1]["wte.weight"][:1000])  # it trained


def test_init_from_with_a_different_config_names_every_field(hf_dirs):
    with pytest.raises(ConfigError) as err:
        GPTLightningModule(config=GPTConfig(name="tiny-llama"), init_from=str(hf_dirs["llama"][0]))
    text = str(err.value)
    assert "model.config.vocab_size=50257 but" in text and "has vocab_size=1000" in text
    assert "model.config.ffn_hidden=160" not in text  # the same value is no problem




def test_init_from_of_another_shape_than_the_config_is_one_error_line(hf_dirs, tmp_path, capsys):
    gpt2_dir = hf_dirs["gpt2"][0]
    cases = [
        (["fit", "--config", "configs/quickstart.yaml", "--model.init_from", gpt2_dir,
          "--trainer.max_steps", "1", "--trainer.default_root_dir", tmp_path / "run"],
         "model.config.block_size=128 but"),  # the quickstart config is another shape
    ]
    for argv, expected in cases:
        line = one_error_line(capsys, argv)
        assert expected in line, (expected, line)


def test_init_from_with_another_tokenizer_than_the_data_is_one_error_line(hf_dirs, tmp_path,
                                                                          capsys, monkeypatch):
    """Weights trained with one tokenizer and data tokenized with another: `fit` stops before it
    prepares the embedded corpus or builds the model, with one line naming data.tokenizer and the
    value that fits, exit status 2, no traceback, no checkpoint. (Following the line trains: run
    by hand; here it would prepare the corpus a second time.)"""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    monkeypatch.chdir(tmp_path)  # whatever Lightning writes by default lands here
    monkeypatch.setenv("FP8L_CACHE", str(tmp_path / "cache"))  # where the corpus would be prepared
    directory = tmp_path / "llama"  # the tiny Llama with a tokenizer of its own (not GPT-2's)
    directory.mkdir()
    for name in ("config.json", "model.safetensors"):
        (directory / name).write_bytes((hf_dirs["llama"][0] / name).read_bytes())
    tk = Tokenizer(models.BPE(unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(["to be or not to be"] * 20,
                           trainers.BpeTrainer(special_tokens=["[UNK]", "</s>"], vocab_size=60))
    tk.save(str(directory / "tokenizer.json"))
    run = tmp_path / "run"
    code, _, err = run_main(capsys, ["fit", "--model.init_from", directory, "--trainer.max_steps", "1",
                            "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
                            "--data.batch_size", "2", "--data.num_workers", "0",
                            "--trainer.default_root_dir", run])  # data.tokenizer: gpt2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2, err[-2000:]
    assert len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert (f"data.tokenizer='gpt2' but the weights of model.init_from were trained with "
            f"'{directory.resolve()}'; set --data.tokenizer {directory.resolve()}") in errors[0]
    assert "model.config.vocab_size" not in errors[0]  # the weights fix it: the tokenizer is the fix
    assert "model: weights from" not in err  # stopped before the model was built
    assert not list((tmp_path / "cache").glob("*/meta.json"))  # nor a minute preparing the corpus
    assert not list(run.rglob("*.ckpt"))


def test_readme_fine_tune_config_has_hugging_face_gpt2s_shape(tmp_path):
    """README: `fit --config configs/gpt2_fp8.yaml --model.init_from hf/gpt2` needs no
    --model.config: the config's model is the shape of Hugging Face's GPT-2 (124M)."""
    import yaml

    from fp8_lightning.hf import init_config

    transformers.GPT2Config().save_pretrained(tmp_path)  # gpt2's config.json: the defaults
    root = Path(__file__).resolve().parents[1]
    model = yaml.safe_load((root / "configs" / "gpt2_fp8.yaml").read_text())["model"]
    ours = GPTConfig(**model["config"])
    assert init_config(str(tmp_path), ours).to_dict() == ours.to_dict()
