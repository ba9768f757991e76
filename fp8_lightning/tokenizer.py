"""Tokenizers: GPT-2 BPE (tiktoken, built offline from files in the package) or any Hugging Face
``tokenizer.json`` (the ``tokenizers`` package). No network, ever."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Optional, Protocol

from .config import ConfigError

ASSETS = Path(__file__).parent / "assets"
# sha256 of the original GPT-2 BPE files (the values tiktoken's own gpt2 loader checks).
GPT2_FILES = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
EOT_TEXT = "<|endoftext|>"


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class GPT2Tokenizer:
    """GPT-2 BPE via tiktoken, from the BPE files shipped in ``fp8_lightning/assets/gpt2``."""

    name = "gpt2"

    def __init__(self) -> None:
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks
        from tiktoken_ext.openai_public import r50k_pat_str

        ranks = data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(ASSETS / "gpt2" / "vocab.bpe"),
            encoder_json_file=str(ASSETS / "gpt2" / "encoder.json"),
            vocab_bpe_hash=GPT2_FILES["vocab.bpe"],
            encoder_json_hash=GPT2_FILES["encoder.json"],
        )
        self._enc = tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                      special_tokens={EOT_TEXT: 50256}, explicit_n_vocab=50257)
        self.vocab_size = self._enc.n_vocab
        self.eot_id = self._enc.eot_token

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)


class HFTokenizer:
    """Any Hugging Face ``tokenizer.json`` (Llama 3, Mistral, ...) through ``tokenizers``."""

    EOT_CANDIDATES = (EOT_TEXT, "<|end_of_text|>", "</s>", "<eos>", "[SEP]")

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _Tok

        self.name = str(path)
        try:
            if Path(path).is_dir():  # vocab.json + merges.txt: a byte-level BPE (GPT-2 style)
                self._tok = byte_level_bpe(Path(path) / "vocab.json", Path(path) / "merges.txt")
            else:
                self._tok = _Tok.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for any unreadable file
            what = "tokenizer directory" if Path(path).is_dir() else "tokenizer.json"
            raise ConfigError([f"tokenizer={str(path)!r} is not a valid Hugging Face {what} "
                               f"({err}); valid: 'gpt2', the tokenizer.json saved with a model, "
                               "or a directory with tokenizer.json or vocab.json + merges.txt"],
                              "tokenizer") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        ids = [self._tok.token_to_id(t) for t in self.EOT_CANDIDATES]
        found = [i for i in ids if i is not None]
        if not found:
            raise ConfigError([f"tokenizer={str(path)!r}: none of the end-of-text tokens "
                               f"{', '.join(self.EOT_CANDIDATES)} is in its vocabulary (prepare "
                               "puts one after every document)"], "tokenizer")
        self.eot_id = found[0]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def byte_level_bpe(vocab_file: Path, merges_file: Path) -> object:
    """A ``tokenizers`` byte-level BPE (GPT-2's kind) from a ``vocab.json`` and ``merges.txt``,
    with ``<|endoftext|>`` as its special token when the vocabulary has it."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers

    tok = _Tok(models.BPE.from_file(str(vocab_file), str(merges_file)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if tok.token_to_id(EOT_TEXT) is not None:
        tok.add_special_tokens([AddedToken(EOT_TEXT, special=True, normalized=False)])
    return tok


def _has_bpe_files(directory: Path) -> bool:
    return (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file()


def _merges(lines: list) -> list[str]:
    """Merges as "a b" strings (tokenizer.json stores pairs or strings; merges.txt has a header)."""
    return [" ".join(m) if isinstance(m, list) else m for m in lines
            if m and not str(m).startswith("#version")]


@functools.lru_cache(maxsize=1)
def _gpt2_bpe() -> tuple[dict, list[str]]:
    return (json.loads((ASSETS / "gpt2" / "encoder.json").read_text()),
            _merges((ASSETS / "gpt2" / "vocab.bpe").read_text().splitlines()))


def tokenizer_of(directory: str | Path) -> Optional[str]:
    """The tokenizer a Hugging Face model directory ships: ``gpt2`` when it is GPT-2's BPE (the
    package's own, so prepared datasets are shared), else the directory; ``None`` without one."""
    path = Path(directory).expanduser().resolve()
    try:
        if (path / "tokenizer.json").is_file():
            model = json.loads((path / "tokenizer.json").read_text()).get("model") or {}
            found = (model.get("vocab"), _merges(model.get("merges") or []))
        elif _has_bpe_files(path):
            found = (json.loads((path / "vocab.json").read_text()),
                     _merges((path / "merges.txt").read_text().splitlines()))
        else:
            return None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return str(path)  # get_tokenizer says what is wrong with it
    return "gpt2" if found == _gpt2_bpe() else str(path)


def tokenizer_key(name: str) -> str:
    """What a tokenizer name (``gpt2``, a tokenizer.json, a model directory) means, by content:
    ``gpt2`` for GPT-2's BPE wherever it lies, else ``sha256:<digest>`` of its files (a copy
    elsewhere is the same tokenizer), else the resolved path (no tokenizer file there)."""
    if name == "gpt2":
        return name
    path = Path(name).expanduser().resolve()
    directory = path if path.is_dir() else path.parent if path.name == "tokenizer.json" else None
    if directory is not None and tokenizer_of(directory) == "gpt2":
        return "gpt2"
    if path.is_file():
        files = [path]
    elif (path / "tokenizer.json").is_file():
        files = [path / "tokenizer.json"]
    else:
        files = [path / n for n in ("vocab.json", "merges.txt") if (path / n).is_file()]
    if not files:
        return str(path)
    return "sha256:" + hashlib.sha256("".join(sha256(f) for f in files).encode()).hexdigest()


def same_tokenizer(a: str, b: str) -> bool:
    """Do two tokenizer names mean the same tokenizer (:func:`tokenizer_key`)?"""
    return tokenizer_key(a) == tokenizer_key(b)


@functools.lru_cache(maxsize=8)
def get_tokenizer(name: str = "gpt2") -> Tokenizer:
    """``"gpt2"``, the path of a Hugging Face ``tokenizer.json``, or a model directory holding
    one (or GPT-2-style ``vocab.json`` + ``merges.txt``)."""
    if name == "gpt2":
        return GPT2Tokenizer()
    path = Path(name).expanduser()
    if path.is_dir() and not (path / "tokenizer.json").is_file() and _has_bpe_files(path):
        return HFTokenizer(str(path))
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.suffix == ".json" and path.is_file():
        return HFTokenizer(str(path))
    why = "is not a .json file" if path.is_file() else f"no such file {str(path)!r}"
    raise ConfigError([f"tokenizer={name!r}: {why}; valid values are 'gpt2' or the path of an "
                       "existing Hugging Face tokenizer.json (or a directory holding one)"],
                      "tokenizer")


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
