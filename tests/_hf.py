"""Tiny Hugging Face models built from a config (random weights, saved locally; no network), for
the tests of ``hf.py`` (tests/test_hf.py) and of the ``convert`` command
(tests/commands/test_convert.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fp8_lightning.tokenizer import byte_level_bpe

transformers = pytest.importorskip("transformers")

TINY = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=50257, n_positions=64, n_embd=64, n_layer=2, n_head=4)),
    # GQA, untied head, a vocabulary that needs padding, Llama 3's RoPE base
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=500000.0)),
    # Llama 3.1 / 3.2's RoPE scaling; an original context of 16 puts head_dim 16's frequencies
    # in all three bands (kept, interpolated, divided by the factor)
    "llama3.1": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 16})),
    # Qwen2 / 2.5: biases on q, k and v only; a tied head as the small Qwen2.5 models have
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=1000000.0, tie_word_embeddings=True)),
    # Mistral without a sliding window (v0.2 on), read as Llama
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        sliding_window=None)),
    # an explicit head_dim wider than hidden / heads (attention 4 x 32 = 128 wide, stream 64)
    "llama-head-dim": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64)),
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


def write_dir(root: Path, name: str, config: dict, tensors: dict | None = None) -> Path:
    from safetensors.torch import save_file

    directory = root / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(directory / "model.safetensors"))
    return directory
