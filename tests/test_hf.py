"""Hugging Face weights in and out (``convert``, ``model.init_from``), against ``transformers``
itself: tiny GPT-2 and Llama models built from a config (random weights, saved locally; no
network)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import lightning as L
import pytest
import torch

from fp8_lightning.config import ConfigError, GPTConfig
from fp8_lightning.fp8 import FP8Precision
from fp8_lightning.hf import load_hf, load_into
from fp8_lightning.model import GPT
from fp8_lightning.module import GPTLightningModule
from fp8_lightning.tokenizer import byte_level_bpe
from tests._runs import run_main

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402  (after the skip: an optional extra)

TINY = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=50257, n_positions=64, n_embd=64, n_layer=2, n_head=4)),
    # GQA, untied head, a vocabulary that needs padding, Llama 3's RoPE base
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=500000.0)),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """{arch: (directory, the transformers model in eval mode)}."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    dirs = {}
    for arch, build in TINY.items():
        model = build().eval()
        model.save_pretrained(root / arch)
        if arch == "gpt2":  # a GPT-2 directory as the Hub has it: its BPE as tokenizer.json
            assets = Path(__file__).resolve().parents[1] / "fp8_lightning" / "assets" / "gpt2"
            byte_level_bpe(assets / "encoder.json", assets / "vocab.bpe").save(
                str(root / arch / "tokenizer.json"))
        dirs[arch] = (root / arch, model)
    return dirs




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


@pytest.mark.parametrize("arch", TINY)
def test_round_trip_in_then_out_is_identical_and_loads_in_transformers(hf_dirs, arch, tmp_path,
                                                                        capsys):
    directory, reference = hf_dirs[arch]
    ckpt, out = tmp_path / "model.ckpt", tmp_path / "out"
    assert run_main(capsys, ["convert", "--from-hf", directory, ckpt])[0] == 0
    code, printed, _ = run_main(capsys, ["convert", "--to-hf", ckpt, out])
    assert code == 0
    original, written = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert written.keys() <= original.keys()
    assert original.keys() - written.keys() <= {"lm_head.weight"}  # tied: stored once
    for key, tensor in written.items():
        assert torch.equal(tensor, original[key]), key
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded) is type(reference)
    idx = torch.randint(0, reference.config.vocab_size, (1, 16))
    with torch.no_grad():
        assert torch.equal(loaded(idx).logits, reference(idx).logits)
    if arch == "gpt2":  # the package's GPT-2 BPE files, under Hugging Face's names
        tok = transformers.AutoTokenizer.from_pretrained(out)
        assert tok("Hello world")["input_ids"] == [15496, 995]
    else:  # the Llama directory ships no tokenizer: none is guessed (GPT-2's would be garbage)
        assert not list(out.glob("tokenizer*")) and not (out / "vocab.json").exists()
        assert "no tokenizer: the checkpoint records none and its vocabulary (1000)" in printed


def test_converted_checkpoint_generates_and_records_its_tokenizer(hf_dirs, tmp_path, capsys):
    ckpt = tmp_path / "gpt2.ckpt"
    run_main(capsys, ["convert", "--from-hf", hf_dirs["gpt2"][0], ckpt])
    recorded = torch.load(ckpt, weights_only=True)["fp8_lightning"]
    assert recorded["tokenizer"] == "gpt2"  # its tokenizer.json is GPT-2's BPE
    code, out, err = run_main(capsys, ["generate", "--ckpt", ckpt, "--prompt", "Hello",
                              "--max_new_tokens", "4", "--temperature", "0"])
    assert code == 0 and out.startswith("Hello"), err


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


def write_dir(root: Path, name: str, config: dict, tensors: dict | None = None) -> Path:
    from safetensors.torch import save_file

    directory = root / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_bad_input_is_one_error_line_naming_the_file_and_field(hf_dirs, tmp_path, capsys):
    gpt2_dir = hf_dirs["gpt2"][0]
    gpt2_config = json.loads((gpt2_dir / "config.json").read_text())
    not_hf = tmp_path / "not_hf"
    not_hf.mkdir()
    (not_hf / "weights.txt").write_text("x")
    bert = write_dir(tmp_path, "bert", {"model_type": "bert", "hidden_size": 64})
    exact_gelu = write_dir(tmp_path, "gelu", dict(gpt2_config, activation_function="gelu"),
                           load_file(gpt2_dir / "model.safetensors"))
    short = dict(load_file(gpt2_dir / "model.safetensors"))
    short.pop("transformer.h.1.mlp.c_fc.weight")
    missing_tensor = write_dir(tmp_path, "missing", gpt2_config, short)
    pickled = write_dir(tmp_path, "pickled", gpt2_config)
    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps({"a": 1}))
    cases = [
        (["convert", "--from-hf", not_hf, tmp_path / "a.ckpt"], f"{not_hf}: no config.json"),
        (["convert", "--from-hf", bert, tmp_path / "b.ckpt"], "model_type='bert' is not supported"),
        (["convert", "--from-hf", exact_gelu, tmp_path / "c.ckpt"], "activation_function='gelu'"),
        (["convert", "--from-hf", missing_tensor, tmp_path / "d.ckpt"],
         "tensor 'h.1.mlp.c_fc.weight' is missing"),
        (["convert", "--from-hf", pickled, tmp_path / "e.ckpt"], "never unpickled"),
        (["convert", "--from-hf", tmp_path / "nowhere", tmp_path / "f.ckpt"], "does not exist"),
        (["convert", "--to-hf", tmp_path / "nothing.ckpt", tmp_path / "out"], "does not exist"),
        (["convert", tmp_path / "x"], "give exactly one of --from_hf DIR or --to_hf CHECKPOINT"),
        (["fit", "--config", "configs/quickstart.yaml", "--model.init_from", gpt2_dir,
          "--trainer.max_steps", "1", "--trainer.default_root_dir", tmp_path / "run"],
         "model.config.block_size=128 but"),  # the quickstart config is another shape
    ]
    for argv, expected in cases:
        code, out, err = run_main(capsys, argv)
        lines = [line for line in err.splitlines() if line.strip() and "INFO" not in line
                 and "WARNING" not in line]
        assert code == 2, (argv, err)
        assert len(lines) == 1 and lines[0].startswith("error:"), (argv, err)
        assert expected in lines[0], (expected, lines[0])
        assert "Traceback" not in err
    assert not (tmp_path / "a.ckpt").exists() and not list(tmp_path.glob(".*tmp*"))
    # an existing output directory is never overwritten
    out = tmp_path / "taken"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    ckpt = tmp_path / "g.ckpt"
    run_main(capsys, ["convert", "--from-hf", gpt2_dir, ckpt])
    code, _, err = run_main(capsys, ["convert", "--to-hf", ckpt, out])
    assert code == 2 and "exists and is not empty" in err and (out / "mine.txt").read_text() == "keep"


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
