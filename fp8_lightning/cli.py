"""Command line: ``python -m fp8_lightning {fit,validate,test,predict,prepare,generate,compare} ...``.

``fit``/``validate``/``test``/``predict`` are LightningCLI (configs, ``--print_config``, dotted
overrides such as ``--trainer.max_steps 30``). The other subcommands are plain functions whose
signatures and docstrings jsonargparse turns into options and help.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Optional

from lightning.pytorch.cli import LightningCLI

from .config import ConfigError
from .data import TokenShardDataModule, prepare
from .module import GPTLightningModule

log = logging.getLogger("fp8_lightning")


class FP8LightningCLI(LightningCLI):
    """LightningCLI for a ``GPTLightningModule`` on a ``TokenShardDataModule``."""

    def add_arguments_to_parser(self, parser) -> None:
        # The data's sequence length is the model's block size: one number, set once.
        parser.link_arguments("model", "data.seq_len", compute_fn=lambda m: m.config.block_size,
                              apply_on="instantiate")


def _run_function(fn: Callable, argv: list[str]) -> Any:
    from jsonargparse import auto_cli

    return auto_cli(fn, args=argv, as_positional=False, prog=f"python -m fp8_lightning {fn.__name__}")


def prepare_command(argv: list[str]) -> None:
    _run_function(prepare, argv)


def generate_command(argv: list[str]) -> None:
    from .generate import generate

    print(_run_function(generate, argv))


def compare_command(argv: list[str]) -> None:
    from .compare import main as compare_main

    compare_main(argv)


EXTRA_COMMANDS: dict[str, Callable[[list[str]], None]] = {
    "prepare": prepare_command,
    "generate": generate_command,
    "compare": compare_command,
}


USER_ERRORS = (ConfigError, FileNotFoundError)


def user_error(err: BaseException) -> Optional[BaseException]:
    """The user error (bad config, missing file) behind ``err``, if any (jsonargparse wraps them)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, USER_ERRORS):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def main(argv: Optional[list[str]] = None) -> None:
    args = None if argv is None else list(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if argv and argv[0] in EXTRA_COMMANDS:
            EXTRA_COMMANDS[argv[0]](argv[1:])
            return
        FP8LightningCLI(
            GPTLightningModule, TokenShardDataModule, args=args,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"description": "FP8 GPT training on Lightning. Also: "
                           + ", ".join(f"`{c} --help`" for c in EXTRA_COMMANDS)},
        )
    except Exception as err:
        found = user_error(err)
        if found is None:
            raise
        # A user error: one clear message, no traceback wall.
        print(f"error: {found}", file=sys.stderr)
        raise SystemExit(2) from None
