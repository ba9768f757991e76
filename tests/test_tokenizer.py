import pytest

from fp8_lightning.data.streaming import EMBEDDED_CORPUS, EMBEDDED_SHA256
from fp8_lightning.tokenizer import ASSETS, GPT2_FILES, get_tokenizer, same_tokenizer, sha256


def test_shipped_files_have_the_expected_checksums():
    for name, digest in GPT2_FILES.items():
        assert sha256(ASSETS / "gpt2" / name) == digest
    assert sha256(EMBEDDED_CORPUS) == EMBEDDED_SHA256


def test_gpt2_tokenizer_is_the_real_gpt2_encoding_offline():
    tok = get_tokenizer("gpt2")
    assert tok.encode("Hello world") == [15496, 995]
    assert (tok.vocab_size, tok.eot_id) == (50257, 50256)
    text = "First Citizen:\nBefore we proceed any further, hear me speak."
    assert tok.decode(tok.encode(text)) == text


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE(unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(["to be or not to be"] * 20,
                           trainers.BpeTrainer(special_tokens=["[UNK]", "</s>"], vocab_size=60))
    tk.save(str(tmp_path / "tokenizer.json"))
    tok = get_tokenizer(str(tmp_path))
    assert tok.eot_id == tk.token_to_id("</s>")
    assert tok.decode(tok.encode("to be")).replace(" ", "") == "tobe"


def test_same_tokenizer_compares_content_not_paths(tmp_path):
    from fp8_lightning.tokenizer import byte_level_bpe

    gpt2_json = tmp_path / "hub-gpt2"  # GPT-2's BPE as a Hub directory has it
    gpt2_json.mkdir()
    byte_level_bpe(ASSETS / "gpt2" / "encoder.json", ASSETS / "gpt2" / "vocab.bpe").save(
        str(gpt2_json / "tokenizer.json"))
    assert same_tokenizer("gpt2", str(gpt2_json))
    assert same_tokenizer(str(gpt2_json / "tokenizer.json"), "gpt2")
    mine, copy = tmp_path / "mine", tmp_path / "copy"
    for folder, text in ((mine, '{"model": {"vocab": {"a": 0}}}'), (copy, '{"model": {"vocab": {"a": 0}}}')):
        folder.mkdir()
        (folder / "tokenizer.json").write_text(text)
    assert same_tokenizer(str(mine), str(copy / "tokenizer.json"))  # a copy elsewhere: the same
    (copy / "tokenizer.json").write_text('{"model": {"vocab": {"b": 0}}}')
    assert not same_tokenizer(str(mine), str(copy))  # same name, other content: not the same
    assert not same_tokenizer("gpt2", str(mine))


def test_unknown_tokenizer_is_a_clear_error():
    with pytest.raises(ValueError, match="valid values are 'gpt2' or the path"):
        get_tokenizer("llama-nonexistent")


def test_a_tokenizer_without_end_of_text_or_not_a_tokenizer_is_a_config_error(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from fp8_lightning.config import ConfigError

    tk = Tokenizer(models.BPE(unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(["to be or not to be"] * 20,
                           trainers.BpeTrainer(special_tokens=["[UNK]"], vocab_size=40))
    tk.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match="none of the end-of-text tokens"):
        get_tokenizer(str(tmp_path))
    (tmp_path / "other.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(ConfigError, match="other.json' is not a valid Hugging Face tokenizer.json"):
        get_tokenizer(str(tmp_path / "other.json"))
