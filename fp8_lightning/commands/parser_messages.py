"""jsonargparse's parse errors as one line: the key, the value and what is valid.

jsonargparse reports a failed validation as text only (see below), so the CLI's ``error:`` line
for a bad option is read out of that text here, the one place that does.
"""

from __future__ import annotations

import importlib
import inspect
import re
import typing
from typing import Any, Optional

from jsonargparse import ArgumentError

from ..config import UsageError
from ..fp8 import moved_option

# jsonargparse reports a failed validation as text only: the ArgumentError that parsing raises
# has no argument name (None), its causes are plain TypeError/ValueError, and no public API gives
# the key, the value or the type that was expected. These patterns of its messages are the one
# place that reads them; what is valid for a class's option comes from its signature.
_KEY = re.compile(r'Parser key "([^"]+)"')  # outermost first: "trainer.plugins", then "recipe"
_EXPECTED = re.compile(r"Expected an? (.+?)\. Got value: (.*)")  # a plain type's failure
_GIVEN = re.compile(r"Given value: (.*)")  # a union's failure, innermost first
_UNKNOWN = re.compile(r"Option '(\w+)' is not accepted")
_CLASS_PATH = re.compile(r"class_path(?:': |=| )'([\w.]+)'")


def short_parser_message(message: str) -> str:
    """jsonargparse's message cut to what the user needs: the key, the value and what is valid.

    Its union errors list every type the key could have had (80+ lines for ``trainer.plugins``);
    the useful part is the innermost ``Parser key "K": Expected <type>. Got value: V``.
    """
    keys = _KEY.findall(message)
    expected = _EXPECTED.findall(message)
    if keys and expected:
        kind, value = expected[0]
        literal = re.fullmatch(r"typing\.Literal\[(.*)\]", kind)
        kind = ("one of " + literal.group(1).replace("'", "")) if literal else \
            re.sub(r"<class '(\w+)'>", r"\1", kind)
        return f"{keys[-1]}={value.strip()!r}: expected {kind}"
    unknown = _UNKNOWN.findall(message)
    classes = _CLASS_PATH.findall(message)
    given = _GIVEN.findall(message)
    nested = len(keys) > 1 and given  # an option inside a class's init_args
    known = {p for c in map(import_class, classes) if c is not None
             for p in inspect.signature(c).parameters}
    # an option no class named has (a union's other branches refuse the valid ones too)
    unknown = [k for k in unknown if k not in known] or ([] if nested else unknown)
    if keys and (nested or unknown):
        key, value = (unknown[-1], None) if unknown else (keys[-1], given[0].strip())
        # the component's path: "trainer.plugins", then each nested component's key
        owners = keys[1:] if unknown else keys[1:-1]
        where = keys[0] + "".join(f".init_args.{k}" for k in owners)
        # the innermost component given (an unknown option's owner), then every class named
        innermost = _CLASS_PATH.findall(given[0]) if unknown and given else []
        cls = next((c for c in map(import_class, classes) if c is not None and key in
                    inspect.signature(c).parameters),
                   import_class((innermost or classes)[0]) if classes else None)
        params = inspect.signature(cls).parameters if cls else {}
        if key in params:  # an option of the class: its value is wrong
            return f"{where}.init_args.{key}={value!r}: expected " + \
                _expected(typing.get_type_hints(cls.__init__).get(key))
        owner = f" of {cls.__name__}" if cls else ""
        moved = moved_option(key) if cls is not None and "recipe" in params else None
        return f"{where}: {key!r} is not an option{owner}" + (f" ({moved})" if moved else "")
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return "; ".join(lines[:3])


def _expected(hint: Any) -> str:
    """What an option's type hint allows, in a config's words."""
    literals = _literals(hint)
    if literals:
        return "one of " + ", ".join(literals)
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    said = " or ".join(words.get(a, getattr(a, "__name__", str(a))) for a in args)
    return said + (" (or null)" if type(None) in typing.get_args(hint) else "")


def _literals(hint: Any) -> list[str]:
    """The string values a ``Literal`` (or an ``Optional`` of one) allows."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        return [a for a in args if isinstance(a, str)]
    return [v for a in args for v in _literals(a)]


def import_class(path: str) -> Optional[type]:
    """The class a dotted path names, or None where it cannot be imported."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def usage_error(err: ArgumentError, prog: str) -> UsageError:
    """A parser's error as one line (the field, the value, what is valid), not a usage dump."""
    return UsageError(f"{short_parser_message(err.message)} (options: {prog} --help)")
