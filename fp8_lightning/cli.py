"""Command line: ``python -m fp8_lightning {fit,validate,test,predict,prepare,checkpoints,generate,compare,convert,bench,doctor} ...``.

``fit``/``validate``/``test``/``predict`` are LightningCLI (configs, ``--print_config``, dotted
overrides such as ``--trainer.max_steps 30``). The other subcommands are plain functions whose
signatures and docstrings jsonargparse turns into options and help.

Bad input of any kind ends in one ``error:`` line and exit status 2 (:func:`main`); a run stopped
by a signal says where its last checkpoint is and exits non-zero.
"""

from __future__ import annotations

import inspect
import logging
import os
import signal
import sys
import time
from functools import partial
from typing import Any, Callable, Optional, Union

from jsonargparse import ArgumentError, Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from .callbacks.checkpoint import Checkpoint
from .callbacks.guard import NonFiniteTrainingError
from .checkpoint_files import CheckpointError, find_checkpoint, load_checkpoint_file, recorded_config
from .commands.bench import bench
from .commands.checkpoints import checkpoints, consolidate
from .commands.doctor import doctor
from .commands.parser_messages import import_class, usage_error
from .commands.run_config import build_component
from .config import ConfigError, UsageError
from .data.prepare import prepare
from .data.streaming import TokenShardDataModule
from .fp8 import FP8UnavailableError
from .logs import TRAIN_LOSS, VAL_LOSS
from .module import GPTLightningModule

log = logging.getLogger("fp8_lightning")

PROG = "python -m fp8_lightning"
TRAINER_COMMANDS = ("fit", "validate", "test", "predict")


def configured_checkpoint_dir(trainer: Namespace) -> Optional[str]:
    """Where the :class:`Checkpoint` callback of a parsed ``trainer`` config writes: its
    ``dirpath``, else ``<default_root_dir>/checkpoints``; None when it has no such callback."""
    callbacks = trainer.get("callbacks") or []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        cls = import_class(str(getattr(callback, "class_path", "")))
        if isinstance(cls, type) and issubclass(cls, Checkpoint):
            dirpath = (callback.get("init_args") or {}).get("dirpath")
            return dirpath or os.path.join(trainer.get("default_root_dir") or os.getcwd(),
                                           "checkpoints")
    return None


# The Trainer's batch limits: a number of batches (int) or a share of the data (float).
BATCH_LIMITS = {"limit_train_batches": "training", "limit_val_batches": "validation",
                "limit_test_batches": "test", "limit_predict_batches": "prediction"}


class ArgumentParser(LightningArgumentParser):
    """LightningCLI's parser that refuses abbreviated options (``--trainer.max_step`` is not
    ``--trainer.max_steps``), raises ``ArgumentError`` on bad input instead of printing a usage
    dump (jsonargparse's ``exit_on_error=False``; :func:`usage_error` makes it one line), and
    keeps a whole number of batches an int (``trainer.limit_*_batches``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("exit_on_error", False)
        super().__init__(*args, **kwargs)

    @override
    def add_class_arguments(self, theclass: Any, nested_key: Optional[str] = None, *args: Any,
                            **kwargs: Any) -> list[str]:
        if not (nested_key and isinstance(theclass, type) and issubclass(theclass, Trainer)):
            return super().add_class_arguments(theclass, nested_key, *args, **kwargs)
        # jsonargparse tries a Union's types in order, and the Trainer's Optional[Union[int,
        # float]] can come out float first: typing caches unions that differ only in order as
        # one object (then `limit_val_batches: 10` reads as 10.0, a fraction). So the limits
        # are skipped in the Trainer's signature and added here, int first, written flat (a
        # nested Optional[Union[...]] would come back from that same cache).
        kwargs["skip"] = {*(kwargs.get("skip") or ()), *BATCH_LIMITS}
        added = super().add_class_arguments(theclass, nested_key, *args, **kwargs)
        group = self.groups.get(nested_key, self)
        for name, data in BATCH_LIMITS.items():
            group.add_argument(f"--{nested_key}.{name}", type=Union[int, float, None],
                               default=None, help=f"How much of the {data} data to run per device: "
                               "a number of batches (int) or a fraction (float). Default: all.")
            added.append(f"{nested_key}.{name}")
        return added


class FP8LightningCLI(LightningCLI):
    """LightningCLI for a ``GPTLightningModule`` on a ``TokenShardDataModule``."""

    resumed_step: Optional[int] = None  # the global step of the checkpoint fit resumes from

    def add_arguments_to_parser(self, parser) -> None:
        # The data's sequence length is the model's block size: one number, set once.
        parser.link_arguments("model", "data.seq_len", compute_fn=lambda m: m.config.block_size,
                              apply_on="instantiate")

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            argv = sys.argv[1:] if args is None else args
            command = argv[0] if isinstance(argv, list) and argv else None
            prog = f"{parser.prog} {command}" if command in self.subcommands() else parser.prog
            raise usage_error(err, prog) from None

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
            checkpoint = load_checkpoint_file(ckpt_path, mmap=True)
            recorded_config(checkpoint, ckpt_path)
            self.resumed_step = checkpoint.get("global_step")

    @override
    def before_instantiate_classes(self) -> None:
        # Our own components check their arguments and raise one ConfigError. Instantiated by
        # jsonargparse inside the `trainer.plugins`/`callbacks`/`strategy` unions, that message is
        # buried in an 80-line dump of every type the key could have had; built here first, the
        # error is the component's own. (Their constructors only validate and store.)
        config = self.config.get(self.config.get("subcommand") or "", self.config)
        trainer = config.get("trainer") or Namespace()
        for key in ("plugins", "callbacks", "strategy"):
            items = trainer.get(key)
            for item in items if isinstance(items, list) else [items]:
                if isinstance(item, Namespace) and str(item.get("class_path", "")).startswith(
                        "fp8_lightning."):
                    cls = import_class(item.class_path)
                    if cls is None:  # jsonargparse names the unknown class
                        continue
                    name = cls.__name__
                    try:
                        cls(**{k: build_component(v) for k, v in
                               (item.get("init_args") or Namespace()).as_dict().items()})
                    except (ValueError, TypeError) as err:
                        if isinstance(err, ConfigError):
                            raise
                        raise ConfigError([f"trainer.{key}: {name}: {err}"]) from None
        check_trainer_arguments(trainer)

    def before_fit(self) -> None:
        # A run resumed at (or past) its max_steps trains nothing, which Lightning does silently.
        max_steps = self.trainer.max_steps
        if self.resumed_step is not None and 0 <= max_steps <= self.resumed_step:
            rank_zero_warn(f"the checkpoint is at step {self.resumed_step} and trainer.max_steps="
                           f"{max_steps}: nothing left to train. To continue, raise it, e.g. "
                           f"--trainer.max_steps {self.resumed_step + max(max_steps, 1)} "
                           "(the learning-rate schedule follows max_steps unless "
                           "model.lr_decay_steps is set)")
        # The embedded corpus is prepared with data.tokenizer on first use (a minute on a small
        # CPU): a tokenizer that does not fit model.init_from's weights is said before that, not
        # in the module's setup after it. (A prepared dataset's tokenizer is checked at setup.)
        data, model = self.datamodule, self.model
        if isinstance(data, TokenShardDataModule) and not data.data_dir and \
                isinstance(model, GPTLightningModule):
            problem = model.tokenizer_problem(data.tokenizer)
            if problem:
                raise ConfigError([problem], "model/data")
        self._fit_start = time.perf_counter()

    def after_fit(self) -> None:
        """The run's closing lines: what it did, where its checkpoints are, what to run next."""
        trainer, model = self.trainer, self.model
        if not trainer.is_global_zero:
            return
        seconds = time.perf_counter() - getattr(self, "_fit_start", time.perf_counter())
        took = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
        metrics = trainer.callback_metrics
        losses = [f"{name} {float(metrics[key]):.4f}" for name, key in
                  (("train loss", TRAIN_LOSS), ("val loss", VAL_LOSS)) if key in metrics]
        step = trainer.global_step
        resumed = f" ({step - self.resumed_step} in this run)" if self.resumed_step else ""
        lines = [f"done: step {step}{resumed}, {getattr(model, 'tokens_seen', 0):,} tokens seen; "
                 f"this run took {took}" + (f"; {', '.join(losses)}" if losses else "")]
        # Lightning's record of the last checkpoint this run wrote (none: say nothing about one)
        last = getattr(trainer.checkpoint_callback, "last_model_path", "") or ""
        if last and os.path.exists(last):
            lines.append(f"checkpoints: {os.path.dirname(last)}")
            if os.path.isdir(last):  # sharded (FSDP2): one file first
                lines.append(f"sample: python -m fp8_lightning consolidate {last} model.ckpt && "
                             "python -m fp8_lightning generate --ckpt model.ckpt --prompt \"...\"")
            else:
                lines.append(f"sample: python -m fp8_lightning generate --ckpt {last} "
                             "--prompt \"...\"")
            if trainer.max_steps > 0:
                # The schedule's length stays what it was: the learning rate goes on at its end.
                decay = getattr(model, "hparams", {}).get("lr_decay_steps") or trainer.max_steps
                lines.append("continue: the same command with --ckpt_path last --trainer.max_steps "
                             f"{2 * max(step, 1)} --model.lr_decay_steps {decay}")
        print("\n".join(lines), flush=True)

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Any:
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except ConfigError:
            raise  # our own strategy's, once it knows the devices (FSDP2Strategy.replicate)
        except (MisconfigurationException, ValueError) as err:
            # Lightning's own checks of the Trainer's arguments (devices, accelerator,
            # precision beside a precision plugin, ...): a bad config, not a crash.
            message = str(err).strip().splitlines()[0]
            if message.startswith("Received both `precision="):
                message = ("trainer.precision is set beside a precision plugin (trainer.plugins: "
                           "FP8Precision sets the precision); drop one, e.g. --trainer.plugins null "
                           "for a plain BF16 run")
            raise ConfigError([message], "trainer") from None
        # Lightning picks RichModelSummary whenever `rich` is importable (transformers' and
        # typer's dependency, so often): it prints to the terminal directly, uncounted FLOPs
        # column included, past the console filter that rewrites the plain summary. The plain
        # summary goes through logging, so the console shows the same table either way.
        from lightning.pytorch.callbacks import ModelSummary, RichModelSummary

        trainer.callbacks = [ModelSummary(max_depth=cb._max_depth)
                             if type(cb) is RichModelSummary else cb for cb in trainer.callbacks]
        return trainer

    @override
    def _run_subcommand(self, subcommand: str) -> None:
        ctrl_c: list = []
        previous: Any = ()
        if subcommand == "fit":
            try:
                previous = signal.signal(signal.SIGINT, partial(self._on_ctrl_c, ctrl_c, os.getpid()))
            except ValueError:  # not the main thread: Ctrl-C stays a KeyboardInterrupt
                pass
        try:
            super()._run_subcommand(subcommand)
        except SystemExit:
            # Lightning turns SIGTERM (and, through _on_ctrl_c, a first Ctrl-C) into
            # SIGTERMException, a SystemExit with status 0, after Checkpoint.on_exception saved the
            # step; a second Ctrl-C into sys.exit(1). Say so, with a non-zero status.
            if self.trainer.interrupted:
                raise Interrupted(self.trainer, signal.SIGINT if ctrl_c or not
                                  self.trainer.received_sigterm else signal.SIGTERM) from None
            raise
        finally:
            if previous != ():
                signal.signal(signal.SIGINT, previous)

    def _on_ctrl_c(self, seen: list, pid: int, *_: Any) -> None:
        """A Ctrl-C while training stops as SIGTERM does: after the running step, saving it
        (a KeyboardInterrupt can land mid optimizer step: the weights half updated). Another
        Ctrl-C, or one outside the training loop, interrupts at once, saving nothing new."""
        if os.getpid() != pid:  # a forked data-loader worker (a terminal signals them all)
            return
        signal.signal(signal.SIGINT, signal.default_int_handler)
        seen.append(signal.SIGINT)
        if not self.trainer.training:
            raise KeyboardInterrupt
        log.warning("Ctrl-C: stopping at the end of this step and saving it (Ctrl-C again to stop "
                    "at once)")
        # Several ranks: stop with the others at an agreed step (distributed.AgreedStop); one:
        # Lightning's own SIGTERM flag, its loops raise SIGTERMException at the end of the step.
        from .distributed import AgreedStop

        stop = AgreedStop.of(self.trainer)
        if stop is not None:
            stop.request()
        else:
            self.trainer._signal_connector.received_sigterm = True


class Interrupted(SystemExit):
    """A run stopped by a signal before it finished: non-zero status, where to resume from."""

    def __init__(self, trainer: Any, signum: int) -> None:
        super().__init__(128 + signum)
        self.quiet = trainer.global_rank != 0  # several ranks stop together: one line says it
        last = getattr(trainer.checkpoint_callback, "last_model_path", "") or ""
        saved = getattr(trainer.checkpoint_callback, "_last_ckpt_step", None)
        where = f"the last checkpoint is {last}" if last else "no checkpoint was written"
        if last and saved is not None and saved != trainer.global_step:
            where += f", from step {saved}"  # stopped at once (a second Ctrl-C): not this step
        self.message = (f"stopped by {signal.Signals(signum).name} at step {trainer.global_step} "
                        f"(before the end of the run); {where}. Resume with the same command and "
                        "--ckpt_path last")


def check_trainer_arguments(trainer: Namespace) -> None:
    """Trainer values Lightning accepts but runs wrongly (or fails on seconds into the run)."""
    problems = []
    accumulate = trainer.get("accumulate_grad_batches")
    if accumulate is not None and (not isinstance(accumulate, int) or accumulate < 1):
        problems.append(f"trainer.accumulate_grad_batches={accumulate!r} must be an integer >= 1")
    log_every = trainer.get("log_every_n_steps")
    if log_every is not None and (not isinstance(log_every, int) or log_every < 1):
        problems.append(f"trainer.log_every_n_steps={log_every!r} must be an integer >= 1 "
                        "(Lightning would silently use 50)")
    for key in ("limit_train_batches", "limit_val_batches", "limit_test_batches",
                "limit_predict_batches"):
        value = trainer.get(key)
        if value is not None and (value < 0 or (isinstance(value, float) and value > 1.0)):
            problems.append(f"trainer.{key}={value!r}: give a number of batches (an integer >= 0)"
                            " or a fraction of the data (0.0 to 1.0)")
    if problems:
        raise ConfigError(problems, "trainer")


class FunctionParser(ArgumentParser):
    """The same one-line errors and no abbreviations for the plain-function commands."""


def _run_function(fn: Callable, argv: list[str]) -> Any:
    # Not jsonargparse's auto_cli: it reserves `--config` for config files (dropping a function's
    # own `config` argument) and exits with a usage dump on bad input.
    parser = FunctionParser(prog=f"{PROG} {fn.__name__}",
                            description=inspect.getdoc(fn).split("\n\n")[0])
    parser.add_function_arguments(fn, as_group=False)
    try:
        args = parser.parse_args(argv)
    except ArgumentError as err:
        raise usage_error(err, parser.prog) from None
    return fn(**args.as_dict())


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
    from .commands.generate import generate

    print(_run_function(generate, argv))


def compare_command(argv: list[str]) -> None:
    from .commands.compare import compare

    # `compare RUN_DIR ... --labels A B ...` (positional runs, several labels after one flag) as
    # well as jsonargparse's own `--run_dirs+ RUN_DIR` / `--labels [A,B]`.
    args: list[str] = []
    flag: Optional[str] = None  # the option whose value comes next
    for arg in argv:
        if arg.startswith("-"):
            arg = "--output" if arg == "-o" else arg
            flag = arg if "=" not in arg and arg not in ("-h", "--help") else None
            args += [] if arg == "--labels" else [arg]
        elif flag == "--labels":  # it takes every value that follows
            args += ["--labels+", arg]
        elif flag:
            args.append(arg)
            flag = None
        else:
            args += ["--run_dirs+", arg]
    if not any(a.startswith(("--run_dirs", "-h", "--help")) for a in args):
        raise UsageError(f"compare needs at least one RUN_DIR (options: {PROG} compare --help)")
    _run_function(compare, args)


def convert_command(argv: list[str]) -> None:
    from .commands.convert import convert

    # `convert --from-hf DIR OUT.ckpt` / `--to-hf CKPT DIR`: dashes as the README spells them,
    # and the output as the one positional argument.
    argv = [a.replace("--from-hf", "--from_hf").replace("--to-hf", "--to_hf") for a in argv]
    flags, positional, i = [], [], 0
    while i < len(argv):
        if argv[i].startswith("-"):
            flags += argv[i:i + 1] if "=" in argv[i] else argv[i:i + 2]
            i += 1 if "=" in argv[i] else 2
        else:
            positional.append(argv[i])
            i += 1
    if len(positional) > 1:
        raise UsageError(f"convert takes one output (got {', '.join(positional)}); e.g. convert "
                         "--from-hf DIR OUT.ckpt or convert --to-hf CKPT DIR")
    _run_function(convert, (["--output", positional[0]] if positional else []) + flags)


EXTRA_COMMANDS: dict[str, Callable[[list[str]], None]] = {
    "prepare": prepare_command,
    "checkpoints": checkpoints_command,
    "consolidate": consolidate_command,
    "bench": bench_command,
    "doctor": doctor_command,
    "generate": generate_command,
    "compare": compare_command,
    "convert": convert_command,
}


USER_ERRORS = (ConfigError, FileNotFoundError, CheckpointError, NonFiniteTrainingError,
               FP8UnavailableError, MisconfigurationException)
# What jsonargparse says when a class it instantiates raises; the cause is the real message.
_WRAPPED = ("Does not validate against any of the Union subtypes", "Not a valid subclass of",
            "Problem with given class_path")


def user_error(err: BaseException) -> Optional[BaseException]:
    """The user error (bad config, missing file) behind ``err``, if any (jsonargparse wraps them)."""
    seen = set()
    chain = []
    while err is not None and id(err) not in seen:
        if isinstance(err, USER_ERRORS):
            return err
        seen.add(id(err))
        chain.append(err)
        err = err.__cause__ or err.__context__
    if chain and str(chain[0]).startswith(_WRAPPED):
        # A class of another package (a Lightning callback, a logger) refused its arguments
        # while jsonargparse instantiated it: its own exception is the innermost one.
        inner = chain[-1]
        return ConfigError([f"{type(inner).__name__}: {str(inner).strip().splitlines()[0]}"])
    return None


def one_line(err: BaseException) -> str:
    """A (possibly multi-line) error message as one line: ``invalid X: a; b``."""
    text = str(err).strip()
    if isinstance(err, ConfigError):
        text = text.replace(":\n  - ", ": ", 1).replace("\n  - ", "; ")
    return " ".join(text.split())


def unknown_command(name: str) -> UsageError:
    import difflib

    valid = [*TRAINER_COMMANDS, *EXTRA_COMMANDS]
    near = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return UsageError(f"unknown command {name!r}{hint}; valid: {', '.join(valid)}")


def check_config_files(argv: list[str]) -> None:
    """Each ``--config FILE`` is a YAML mapping; else one error naming the file and the line.

    (jsonargparse's message for a YAML error names neither the file nor, usefully, the place.)
    """
    import yaml

    paths = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--config", "-c")]
    paths += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise UsageError(f"--config {path!r} does not exist") from None
        except (OSError, UnicodeDecodeError) as err:
            raise UsageError(f"--config {path!r} cannot be read ({err})") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise UsageError(f"--config {path!r} is not valid YAML: {problem}{where}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise UsageError(f"--config {path!r} holds a {type(loaded).__name__}; expected a "
                             "mapping of settings (seed_everything:, trainer:, model:, data:)")


def main(argv: Optional[list[str]] = None) -> None:
    args = None if argv is None else list(argv)  # None: LightningCLI reads sys.argv itself
    argv = list(sys.argv[1:] if argv is None else argv)
    from .console import quiet_console

    quiet_console()
    try:
        if argv and argv[0] in EXTRA_COMMANDS:
            EXTRA_COMMANDS[argv[0]](argv[1:])
            return
        if argv and not argv[0].startswith("-") and argv[0] not in TRAINER_COMMANDS:
            raise unknown_command(argv[0])
        check_config_files(argv)
        FP8LightningCLI(
            GPTLightningModule, TokenShardDataModule, args=args, parser_class=ArgumentParser,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"prog": PROG, "description": "FP8 GPT training on Lightning. Also: "
                           + ", ".join(f"`{c} --help`" for c in EXTRA_COMMANDS)},
        )
    except (UsageError, Interrupted) as err:
        if not getattr(err, "quiet", False):
            print(f"error: {err.message}", file=sys.stderr)
        raise SystemExit(err.code) from None
    except Exception as err:
        found = user_error(err)
        if found is None:
            raise
        # A user error: one clear line, no traceback wall.
        print(f"error: {one_line(found)}", file=sys.stderr)
        raise SystemExit(2) from None
