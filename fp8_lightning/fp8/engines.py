"""The engines by name: what a recipe's ``engine`` field (``fp8/recipes.py``) resolves to."""

from __future__ import annotations

from .engine import Engine
from .te_engine import TEEngine
from .torchao_engine import TorchaoEngine


def get_engine(name: str) -> Engine:
    """The engine called ``name`` (``te`` or ``torchao``)."""
    if name == "te":
        return TEEngine()
    if name == "torchao":
        return TorchaoEngine()
    raise ValueError(f"engine={name!r}; valid: te, torchao")
