"""matplotlib, an optional extra (``plots``): the commands that draw (``bench``, ``compare``)
get it here, or one ``error:`` line naming the extra."""

from __future__ import annotations

from typing import Any

from .config import ConfigError

PLOTS_EXTRA = 'pip install "fp8-lightning[plots]"'


class MissingExtraError(ConfigError):
    """An optional dependency a command needs is not installed (one ``error:`` line)."""

    def __init__(self, message: str) -> None:
        ValueError.__init__(self, message)
        self.problems = [message]


def pyplot(what: str) -> Any:
    """``matplotlib.pyplot`` on the file backend; a one-line error naming the extra without it."""
    try:
        import matplotlib
    except ImportError:
        raise MissingExtraError(f"{what} needs matplotlib: {PLOTS_EXTRA}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
