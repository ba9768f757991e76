import pytest

from fp8_lightning.config import PRESETS, ConfigError, GPTConfig, check_micro_batch


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_valid_and_fp8_ready(name):
    c = GPTConfig.from_name(name)
    assert c.padded_vocab_size % 128 == 0 and c.padded_vocab_size >= c.vocab_size
    for dim in (c.n_embd, c.ffn_hidden, c.head_dim, c.qkv_width):
        assert dim % 16 == 0


def test_gpt2_vocab_is_padded_to_50304(caplog):
    with caplog.at_level("INFO"):
        c = GPTConfig(name="gpt2")
    assert (c.vocab_size, c.padded_vocab_size) == (50257, 50304)
    assert "50257 -> 50304" in caplog.text


def test_presets_match_their_published_shapes():
    l8 = GPTConfig(name="llama3-8b")
    assert (l8.n_layer, l8.n_embd, l8.ffn_hidden, l8.n_head, l8.n_kv_heads, l8.block_size) == \
        (32, 4096, 14336, 32, 8, 8192)
    ls = GPTConfig(name="llama3-small")
    assert (ls.n_layer, ls.n_embd, ls.ffn_hidden, ls.n_head, ls.n_kv_heads, ls.block_size) == \
        (12, 2048, 5504, 16, 4, 2048)
    assert (l8.norm, l8.activation, l8.position) == ("rmsnorm", "swiglu", "rope")
    g = GPTConfig(name="gpt2")
    assert (g.n_layer, g.n_head, g.n_embd, g.n_kv_heads) == (12, 12, 768, 12)


def test_overrides_replace_preset_fields():
    c = GPTConfig.from_name("gpt2", n_layer=2, block_size=256)
    assert (c.n_layer, c.block_size, c.n_embd) == (2, 256, 768)


def test_unknown_preset_names_the_valid_ones():
    with pytest.raises(ConfigError, match="valid: gpt2, gpt2-medium"):
        GPTConfig(name="gpt5")


@pytest.mark.parametrize("overrides, message", [
    (dict(n_embd=100, n_head=4), "n_embd=100 is not a multiple of 16 .* nearest valid: 96"),
    (dict(ffn_hidden=3000), "ffn_hidden=3000 is not a multiple of 16 .* nearest valid: 3008"),
    (dict(n_head=7), "n_head=7 does not divide n_embd=768; nearest valid n_head: 6"),
    (dict(n_kv_heads=5), "n_kv_heads=5 does not divide n_head=12; nearest valid n_kv_heads: 4|6"),
    (dict(norm="batchnorm"), "norm='batchnorm'; valid: layernorm, rmsnorm"),
    (dict(n_layer=0), "n_layer=0 must be a positive integer"),
])
def test_bad_dimensions_name_the_field_and_a_valid_value(overrides, message):
    with pytest.raises(ConfigError, match=message):
        GPTConfig(name="gpt2", **overrides)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "yarn", "factor": 4.0}, r"rope_scaling=.*'yarn'.*valid: \{rope_type: llama3"),
    (dict(LLAMA3, factor=0), r"rope_scaling.factor=0 must be a positive number"),
    (dict(LLAMA3, high_freq_factor=True), r"rope_scaling.high_freq_factor=True must be a positive"),
    (dict(LLAMA3, high_freq_factor=0.5), r"high_freq_factor=0.5 must be above low_freq_factor=1.0"),
    (dict(LLAMA3, beta=1), r"rope_scaling has unknown keys \['beta'\]"),
])
def test_rope_scaling_is_llama3s_or_one_error_naming_the_key(scaling, message):
    with pytest.raises(ConfigError, match=message):
        GPTConfig(name="llama3-8b", rope_scaling=scaling)
    with pytest.raises(ConfigError, match="rope_scaling needs position=rope, not 'learned'"):
        GPTConfig(name="gpt2", rope_scaling=LLAMA3)
    config = GPTConfig(name="llama3-8b", rope_scaling=LLAMA3)  # Llama 3.1 8B's
    assert GPTConfig.from_dict(config.to_dict()) == config  # as checkpoints record it


def test_an_explicit_head_size_sets_the_attention_width_and_must_suit_fp8():
    config = GPTConfig(name="tiny-llama", head_size=32)  # 4 heads of 32: attention 128 wide
    assert (config.head_dim, config.attn_width, config.n_embd) == (32, 128, 64)
    assert config.qkv_width == (config.n_head + 2 * config.n_kv_heads) * 32
    with pytest.raises(ConfigError, match="head_size=24 is not a multiple of 16 .* nearest valid: 32"):
        GPTConfig(name="tiny-llama", head_size=24)
    with pytest.raises(ConfigError, match="head_size=True must be a positive integer or unset"):
        GPTConfig(name="tiny-llama", head_size=True)
    assert GPTConfig(name="gpt2").qkv_bias and not GPTConfig(name="llama3-8b").qkv_bias  # = bias


def test_head_dim_not_multiple_of_16_suggests_a_head_count():
    with pytest.raises(ConfigError) as err:
        GPTConfig(name="gpt2", n_head=64)  # head dim 12
    assert "head dim n_embd/n_head=12" in str(err.value)
    assert "nearest valid n_head: 48" in str(err.value)


def test_all_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as err:
        GPTConfig(name="gpt2", n_embd=770, ffn_hidden=3001, n_kv_heads=5)
    fields = [p.split("=")[0] for p in err.value.problems]
    assert fields == ["n_head", "n_kv_heads", "n_embd", "ffn_hidden"]


def test_padded_vocab_cannot_be_set_inconsistently():
    with pytest.raises(ConfigError, match="valid: 50304"):
        GPTConfig(name="gpt2", padded_vocab_size=50260)
    assert GPTConfig(**GPTConfig(name="gpt2").to_dict()) == GPTConfig(name="gpt2")


def test_micro_batch_tokens_must_be_a_multiple_of_16():
    check_micro_batch(8, 128)
    check_micro_batch(1, 1024)
    with pytest.raises(ConfigError, match=r"data.batch_size=3 x seq_len=100 = 300 .* nearest valid data.batch_size: 4"):
        check_micro_batch(3, 100)
