"""The ``convert`` command: Hugging Face directories in and out, against ``transformers`` itself on
tiny GPT-2, Llama (3.0, 3.1's RoPE scaling, an explicit head_dim), Qwen2 and Mistral models
(tests/_hf.py)."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from tests._hf import TINY, hf_dirs, transformers, write_dir  # noqa: F401 - the fixture
from tests._runs import one_error_line, run_main

from safetensors.torch import load_file  # noqa: E402  (after the skip: an optional extra)


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
    # Mistral without a sliding window is Llama's architecture: it comes back as Llama
    expected = transformers.LlamaForCausalLM if arch == "mistral" else type(reference)
    assert type(loaded) is expected
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
    llama_config = json.loads((hf_dirs["llama"][0] / "config.json").read_text())
    windowed = write_dir(tmp_path, "windowed", dict(llama_config, model_type="mistral",
                                                    sliding_window=16))
    yarn = write_dir(tmp_path, "yarn", dict(llama_config, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}))
    pickled = write_dir(tmp_path, "pickled", gpt2_config)
    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps({"a": 1}))
    cases = [
        (["convert", "--from-hf", not_hf, tmp_path / "a.ckpt"], f"{not_hf}: no config.json"),
        (["convert", "--from-hf", bert, tmp_path / "b.ckpt"], "model_type='bert' is not supported"),
        (["convert", "--from-hf", exact_gelu, tmp_path / "c.ckpt"], "activation_function='gelu'"),
        (["convert", "--from-hf", missing_tensor, tmp_path / "d.ckpt"],
         "tensor 'h.1.mlp.c_fc.weight' is missing"),
        (["convert", "--from-hf", pickled, tmp_path / "e.ckpt"], "never unpickled"),
        (["convert", "--from-hf", windowed, tmp_path / "w.ckpt"], "sliding_window=16: attention "
         "over a window is not supported; valid: null"),
        (["convert", "--from-hf", yarn, tmp_path / "y.ckpt"], "rope scaling 'yarn' "
         "(rope_scaling/rope_parameters) is not supported; valid: default (Llama 3.0), llama3"),
        (["convert", "--from-hf", tmp_path / "nowhere", tmp_path / "f.ckpt"], "does not exist"),
        (["convert", "--to-hf", tmp_path / "nothing.ckpt", tmp_path / "out"], "does not exist"),
        (["convert", tmp_path / "x"], "give exactly one of --from_hf DIR or --to_hf CHECKPOINT"),
    ]
    for argv, expected in cases:
        line = one_error_line(capsys, argv)
        assert expected in line, (expected, line)
    assert not (tmp_path / "a.ckpt").exists() and not list(tmp_path.glob(".*tmp*"))
    # an existing output directory is never overwritten
    out = tmp_path / "taken"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    ckpt = tmp_path / "g.ckpt"
    run_main(capsys, ["convert", "--from-hf", gpt2_dir, ckpt])
    code, _, err = run_main(capsys, ["convert", "--to-hf", ckpt, out])
    assert code == 2 and "exists and is not empty" in err and (out / "mine.txt").read_text() == "keep"
