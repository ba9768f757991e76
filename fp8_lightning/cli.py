"""Command line: ``python -m fp8_lightning {fit,validate,test,predict,prepare,checkpoints,generate,compare,bench,doctor} ...``.

``fit``/``validate``/``test``/``predict`` are LightningCLI (configs, ``--print_config``, dotted
overrides such as ``--trainer.max_steps 30``). The other subcommands are plain functions whose
signatures and docstrings jsonargparse turns into options and help.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any, Callable, Optional

from lightning.pytorch.cli import LightningCLI

from .bench import bench
from .checkpoint import (CheckpointError, checkpoints, configured_checkpoint_dir, consolidate,
                         find_checkpoint, load_checkpoint_file, recorded_config)
from .config import ConfigError
from .data import TokenShardDataModule, prepare
from .fp8 import FP8UnavailableError
from .doctor import doctor
from .module import GPTLightningModule
from .safety import NonFiniteTrainingError

log = logging.getLogger("fp8_lightning")


class FP8LightningCLI(LightningCLI):
    """LightningCLI for a ``GPTLightningModule`` on a ``TokenShardDataModule``."""

    def add_arguments_to_parser(self, parser) -> None:
        # The data's sequence length is the model's block size: one number, set once.
        parser.link_arguments("model", "data.seq_len", compute_fn=lambda m: m.config.block_size,
                              apply_on="instantiate")

    def _parse_ckpt_path(self) -> None:
        # LightningCLI (>= 2.5) merges the checkpoint's hyperparameters over the config, silently
        # replacing what the user set. Here the config decides; a model that does not match the
        # checkpoint is one error naming the fields (GPTLightningModule.on_load_checkpoint), and
        # a missing, truncated or foreign file (or a recorded model field this version does not
        # know) is one error naming the path. The allow-listing loaders read it here, before
        # anything else touches it: no code runs from a crafted checkpoint.
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else {}
        ckpt_path = config.get("ckpt_path")
        directory = configured_checkpoint_dir(config.trainer) if ckpt_path else None
        if ckpt_path in ("last", "best") and directory:
            # The file they name, or an error: Lightning would train from scratch where there is
            # no last checkpoint, and never knows a best one in a new process.
            ckpt_path = config["ckpt_path"] = find_checkpoint(ckpt_path, directory)
        if ckpt_path and ckpt_path not in ("last", "best", "hpc", "registry"):
            recorded_config(load_checkpoint_file(ckpt_path, mmap=True), ckpt_path)


def _run_function(fn: Callable, argv: list[str]) -> Any:
    from jsonargparse import ArgumentParser, auto_cli

    prog = f"python -m fp8_lightning {fn.__name__}"
    if "config" not in inspect.signature(fn).parameters:
        return auto_cli(fn, args=argv, as_positional=False, prog=prog)
    # auto_cli reserves `--config` for config files and drops a function's own `config` argument.
    parser = ArgumentParser(prog=prog, description=inspect.getdoc(fn).split("\n\n")[0])
    parser.add_function_arguments(fn, as_group=False)
    return fn(**parser.parse_args(argv).as_dict())


def prepare_command(argv: list[str]) -> None:
    _run_function(prepare, argv)


def checkpoints_command(argv: list[str]) -> None:
    if argv and not argv[0].startswith("-"):  # `checkpoints DIR` as well as `--directory DIR`
        argv = ["--directory", argv[0], *argv[1:]]
    _run_function(checkpoints, argv)


def consolidate_command(argv: list[str]) -> None:
    positional = []  # `consolidate DIR [OUTPUT]` as well as `--checkpoint DIR --output FILE`
    while argv and not argv[0].startswith("-") and len(positional) < 2:
        positional.append(argv.pop(0))
    flags = [x for pair in zip(("--checkpoint", "--output"), positional) for x in pair]
    _run_function(consolidate, flags + argv)


def bench_command(argv: list[str]) -> None:
    _run_function(bench, argv)


def doctor_command(argv: list[str]) -> None:
    raise SystemExit(_run_function(doctor, argv))


def generate_command(argv: list[str]) -> None:
    from .generate import generate

    print(_run_function(generate, argv))


def compare_command(argv: list[str]) -> None:
    from .compare import main as compare_main

    compare_main(argv)


EXTRA_COMMANDS: dict[str, Callable[[list[str]], None]] = {
    "prepare": prepare_command,
    "checkpoints": checkpoints_command,
    "consolidate": consolidate_command,
    "bench": bench_command,
    "doctor": doctor_command,
    "generate": generate_command,
    "compare": compare_command,
}


USER_ERRORS = (ConfigError, FileNotFoundError, CheckpointError, NonFiniteTrainingError,
               FP8UnavailableError)


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
