"""The engines by name: what a recipe's ``engine`` field (``fp8/recipes.py``) resolves to."""

from __future__ import annotations

from .engine import Engine
from .te_engine import TEEngine
from .torchao_engine import TorchaoEngine

ENGINE_CLASSES: dict[str, type[Engine]] = {"te": TEEngine, "torchao": TorchaoEngine}


def get_engine(name: str) -> Engine:
    """The engine called ``name`` (``te`` or ``torchao``)."""
    if name not in ENGINE_CLASSES:
        raise ValueError(f"engine={name!r}; valid: {', '.join(ENGINE_CLASSES)}")
    return ENGINE_CLASSES[name]()


def engine_backend(name: str) -> str:
    """The model backend whose layers the engine called ``name`` converts (``te`` or ``torch``)."""
    return ENGINE_CLASSES[name].backend
