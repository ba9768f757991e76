"""Reading and tokenizing ``prepare``'s input documents: the function litdata's ``optimize``
runs in its worker processes.

A module of its own that imports no Lightning: the workers are spawned, and each one imports the
module of the function it runs (and its package's ``__init__``, which imports nothing). Importing
Lightning and the whole package there cost each worker seconds on a small CPU, per split and per
``prepare``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from ..config import ConfigError
from ..tokenizer import get_tokenizer


def _not_utf8(where: str, offset: int) -> ConfigError:
    return ConfigError([f"inputs: {where}: not UTF-8 text (invalid byte at offset {offset} of the "
                        "file); convert the file to UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"],
                       "prepare inputs")


def iter_documents(path: str, text_field: str) -> Iterator[str]:
    """A .txt file is one document; a .jsonl file has one document per line in ``text_field``.

    A file that is not UTF-8, an invalid JSON line or a line without a string ``text_field`` is a
    ``ConfigError`` naming the file (and line)."""
    if path.endswith(".txt"):
        try:
            text = Path(path).read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            raise _not_utf8(path, err.start) from None
        # Universal newlines, as read_text() gives: the same text makes the same shards.
        yield text.replace("\r\n", "\n").replace("\r", "\n")
        return
    # Bytes, decoded line by line: a decoding error then names its line and file offset.
    with open(path, "rb") as f:
        offset = 0
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise _not_utf8(f"{path}:{lineno}", offset + err.start) from None
            offset += len(raw)
            if not line.strip():
                continue
            where = f"inputs: {path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError([f"{where}: not valid JSON ({err.msg} at column {err.colno}); "
                                   "each line must be one JSON object such as "
                                   f'{{"{text_field}": "..."}}'], "prepare inputs") from None
            if not isinstance(record, dict) or text_field not in record:
                has = (f"it has {', '.join(map(repr, list(record)[:5]))}"
                       if isinstance(record, dict) else f"it is a JSON {type(record).__name__}")
                raise ConfigError([f"{where}: no field {text_field!r} ({has}); set --text_field "
                                   "to the field holding the text"], "prepare inputs")
            value = record[text_field]
            if not isinstance(value, str):
                raise ConfigError([f"{where}: field {text_field!r} is a JSON "
                                   f"{type(value).__name__}, not a string of text"],
                                  "prepare inputs")
            yield value


def _file_tokens(path: str, tokenizer: str, text_field: str) -> list[int]:
    tok = get_tokenizer(tokenizer)
    ids: list[int] = []
    for doc in iter_documents(path, text_field):
        ids.extend(tok.encode(doc))
        ids.append(tok.eot_id)  # end-of-text after every document
    return ids


def _tokenize_split(path: str, *, split: str, tokenizer: str, text_field: str,
                    val_fraction: float) -> Iterator[torch.Tensor]:
    """litdata ``optimize`` worker: yields this file's train or val tokens (module-level: spawn)."""
    ids = _file_tokens(path, tokenizer, text_field)
    cut = len(ids) - int(len(ids) * val_fraction)
    part = ids[:cut] if split == "train" else ids[cut:]
    if part:
        yield torch.tensor(part, dtype=torch.int32)
