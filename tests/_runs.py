"""The CLI runners of the tests (a process, this process, a run that must fail with one
``error:`` line); short quickstart fits through the CLI, run once per test run (for all xdist
processes) and shared by the console, monitor, generate and bad-input tests (each CLI fit costs
tens of seconds on a small CPU), likewise a prepare with two workers (the console and prepare
tests); and the small vocabulary that fits which are not about the tokenizer train on."""

import concurrent.futures
import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 10
_RUNS: dict = {}

# A byte-level tokenizer: the 256 bytes and <|endoftext|>. The quickstart's GPT-2 vocabulary
# (50,257) makes the embedding and LM head ~95% of the `tiny` model: most of a CPU step, of its
# AdamW update and of every checkpoint (40 MB instead of 2 MB).
BYTES_VOCAB = 257


def load_script(path: str):
    """A script of the repository that is no package module (``scripts/memprobe.py``),
    imported from its file (``examples/`` is a package: ``from examples import own_model``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_cli(*args, timeout=600, launcher=()):
    """``python -m fp8_lightning ARGS`` as a process from the repository root (``launcher``:
    arguments of python before ``-m fp8_lightning``, e.g. ``-m torch.distributed.run ...``). Past ``timeout``
    seconds (at most ``$FP8L_RUN_TIMEOUT`` where set, for a machine whose commands are
    time-limited) every process of the run, the launcher's ranks too, prints its Python stacks
    (faulthandler on SIGABRT) and the test fails with them: a hang says where it waits."""
    timeout = min(timeout, float(os.environ.get("FP8L_RUN_TIMEOUT", "inf")))
    proc = subprocess.Popen([sys.executable, *launcher, "-m", "fp8_lightning", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONFAULTHANDLER="1"), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)  # the ranks share the launcher's process group
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        raise AssertionError(f"fp8_lightning {' '.join(map(str, args[:3]))} ... did not end in "
                             f"{timeout:.0f} s; its stacks:\n{err[-12000:]}\n{out[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_main(capsys, argv):
    """``python -m fp8_lightning ARGV`` in this process (no process to start): (exit status,
    stdout, stderr) of this call alone."""
    capsys.readouterr()
    code = _main_status(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _main_status(argv):
    """The exit status of ``python -m fp8_lightning ARGV`` run in this process."""
    from unittest import mock

    from fp8_lightning.cli import main

    try:
        with mock.patch.object(sys, "argv", ["fp8_lightning"]):  # the args come from argv only
            main([str(a) for a in argv])
        return 0
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)


def cli_error(capsys, *argv):
    """The message of ``python -m fp8_lightning ARGV`` run in this process (:func:`run_main`),
    which must fail with exit status 2 and one ``error:`` line, no traceback: stderr from that
    line on."""
    code, _, err = run_main(capsys, argv)
    error_lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(error_lines) == 1 and "Traceback" not in err, err[-2000:]
    return err[err.index(error_lines[0]):]


def one_error_line(capsys, argv):
    """:func:`run_main` of ``argv``, which must exit with status 2, print exactly one line on
    stderr besides log lines, that line an ``error:`` one, and no traceback; returns the line."""
    code, _, err = run_main(capsys, argv)
    lines = [line for line in err.splitlines() if line.strip() and "INFO" not in line
             and "WARNING" not in line]
    assert code == 2, (argv, err)
    assert len(lines) == 1 and lines[0].startswith("error:"), (argv, err)
    assert "Traceback" not in err
    return lines[0]


def fit_error(capsys, *args):
    """:func:`cli_error` of a 12-step quickstart fit (no logger, no progress bar, micro-batch 4)
    with ``args``; the current directory must be the repository root."""
    return cli_error(capsys, "fit", "--config", "configs/quickstart.yaml", "--trainer.max_steps",
                     "12", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
                     "--data.batch_size", "4", *args)


def byte_tokenizer(path: Path) -> Path:
    """Write a Hugging Face tokenizer.json: byte-level BPE without merges (one token per byte,
    any text round-trips) plus <|endoftext|>, ids 0..256."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    tok.save(str(path))
    return path


def shared_dir(tmp_path_factory, name, make):
    """The directory ``name``, filled by ``make(path)`` once for the whole test run: under xdist
    the first worker process that needs it makes it (behind a file lock) while the others wait,
    then all read it; without xdist, once per session."""
    import shutil

    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above every worker's own
    path = root / name
    with FileLock(f"{path}.lock"):
        if not (path / ".made").is_file():
            shutil.rmtree(path, ignore_errors=True)  # a make that failed part way
            path.mkdir()
            make(path)
            (path / ".made").touch()
    return path


def _prepare_bytes_data(root: Path) -> None:
    from fp8_lightning.data.prepare import prepare
    from fp8_lightning.data.streaming import EMBEDDED_CORPUS, preserved_rng

    (root / "corpus.txt").write_text(EMBEDDED_CORPUS.read_text()[:300_000])
    with preserved_rng():
        meta = prepare([str(root / "corpus.txt")], str(root / "ds"),
                       tokenizer=str(byte_tokenizer(root / "tokenizer.json")), seq_len=128,
                       val_fraction=0.15, num_workers=1)
    assert meta["vocab_size"] == BYTES_VOCAB, meta


def bytes_data(tmp_path_factory) -> Path:
    """A directory with ``tokenizer.json`` (:func:`byte_tokenizer`) and ``ds``, the quickstart
    corpus's first 300,000 characters prepared with it for the quickstart's blocks (129 tokens):
    made once per test run."""
    return shared_dir(tmp_path_factory, "bytes-data", _prepare_bytes_data)


def small_vocab(tmp_path_factory):
    """CLI arguments for a fit on a 257-token vocabulary, for the tests of what a fit does that
    are not about the tokenizer: :func:`bytes_data` and a model of that vocabulary."""
    root = bytes_data(tmp_path_factory)
    # data.tokenizer as well: TrainingMonitor's text sample encodes its prompt with it.
    return ["--data.data_dir", str(root / "ds"), "--data.tokenizer", str(root / "tokenizer.json"),
            "--model.config.vocab_size", str(BYTES_VOCAB)]


def short_fit(tmp_path_factory, name, *overrides):
    """(run dir, CompletedProcess) of a 10-step quickstart fit: lines at steps 5 and 10, one
    validation (2 batches) with a text sample at step 10, last.ckpt. Run once per test run
    (:func:`shared_dir`: the xdist processes share it; tests only read it)."""
    if name not in _RUNS:
        def make(path):
            result = run_cli("fit", "--config", "configs/quickstart.yaml",
                             "--trainer.max_steps", str(STEPS), "--trainer.val_check_interval",
                             str(STEPS), "--trainer.log_every_n_steps", "5",
                             "--trainer.limit_val_batches", "2",
                             "--trainer.default_root_dir", str(path / "run"), *overrides)
            assert result.returncode == 0, result.stderr[-3000:]
            (path / "stdout.txt").write_text(result.stdout)
            (path / "stderr.txt").write_text(result.stderr)

        path = shared_dir(tmp_path_factory, f"fit-{name}", make)
        result = subprocess.CompletedProcess(["fit", name], 0, (path / "stdout.txt").read_text(),
                                             (path / "stderr.txt").read_text())
        _RUNS[name] = (path / "run", result)
    return _RUNS[name]


def small_vocab_fit(tmp_path_factory):
    """:func:`short_fit` on :func:`small_vocab`, once per test run."""
    return short_fit(tmp_path_factory, "small_vocab", *small_vocab(tmp_path_factory))


def two_worker_prepare(tmp_path_factory):
    """(inputs directory, CompletedProcess) of ``python -m fp8_lightning prepare`` of
    ``tests.data.PARTS``, a file each (``part0.txt`` ...), into ``ds`` beside them with two
    spawned workers (seq_len 15, val_fraction 0.1). Run once per test run (:func:`shared_dir`;
    each run costs the spawned workers' start-ups): the console test reads what it printed, the
    prepare test compares its dataset with another run's."""
    if "prepare" not in _RUNS:
        def make(path):
            from tests.data import PARTS

            for i, text in enumerate(PARTS):
                (path / f"part{i}.txt").write_text(text)
            result = run_cli("prepare", "--inputs", str(path / "part*.txt"), "--output_dir",
                             str(path / "ds"), "--seq_len", "15", "--val_fraction", "0.1",
                             "--num_workers", "2")
            assert result.returncode == 0, result.stderr[-3000:]
            (path / "stdout.log").write_text(result.stdout)
            (path / "stderr.log").write_text(result.stderr)

        path = shared_dir(tmp_path_factory, "two-worker-prepare", make)
        _RUNS["prepare"] = (path, subprocess.CompletedProcess(
            ["prepare"], 0, (path / "stdout.log").read_text(), (path / "stderr.log").read_text()))
    return _RUNS["prepare"]


# Several CPU processes (tests/test_distributed.py, tests/test_fsdp2.py)
BATCH = 2  # sequences per rank and step: small, the point is the processes, not the compute
TOKENS_PER_STEP = BATCH * 128  # x seq 128 per rank


def free_port() -> int:
    """A TCP port free on this host now, for a rendezvous of CPU processes."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return free.getsockname()[1]


def torchrun_nodes(nodes: int, per_node: int) -> list[tuple[str, ...]]:
    """The multi-node launch of docs/several-gpus.md on this host: one torchrun per node, each
    starting ``per_node`` processes, meeting at a c10d rendezvous on a free local port (the first
    to come hosts its store); Lightning takes rank and world size from their environment."""
    port = free_port()
    return [("-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc_per_node",
             str(per_node), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
             "--rdzv_id", f"fit{port}")] * nodes


def fit_ranks(root, data, *args, devices=2, config=None, torchrun=False, nodes=1, capsys=None):
    """A quickstart fit of ``devices`` CPU processes (``config``: the strategy's overlay) through
    the CLI on ``data`` (the ``small_vocab`` arguments); its output. Lightning starts the
    processes, or with ``torchrun`` torchrun does, one launch per node of ``nodes``
    (``--trainer.num_nodes`` and ``--trainer.devices`` per node, as in the docs' launch).
    Without ``config``, one process; with ``capsys`` this one (:func:`run_main`: no Python to
    start, for the runs where the process is not what is tested).

    Each process reads its data itself, without loader workers (``--data.num_workers 0``): a
    rank's workers (a forkserver that imports torch, their shutdown at the end) cost a two-process
    fit on a 2-core CPU more than its steps, and these fits are about the ranks, not the loader's
    processes (fits with workers: tests/callbacks/test_checkpoint.py's exact resume,
    tests/test_signals.py)."""
    per_node = devices // nodes
    extra = ["--config", config, "--trainer.accelerator", "cpu", "--trainer.devices",
             str(per_node)] if config else []
    launchers = torchrun_nodes(nodes, per_node) if torchrun else [()]
    if torchrun:
        extra += ["--trainer.num_nodes", str(nodes)]
    argv = ["fit", "--config", "configs/quickstart.yaml", *extra, *data,
            "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "2",
            "--trainer.log_every_n_steps", "3", "--trainer.default_root_dir", str(root),
            "--trainer.callbacks.init_args.every_n_train_steps", "3",
            "--data.batch_size", str(BATCH), "--data.num_workers", "0", *args]
    if capsys is not None:
        assert not config, "several processes run through the CLI's process"
        code, log = run_main_logged(capsys, argv)
        assert code == 0, log[-5000:]
        return log
    with concurrent.futures.ThreadPoolExecutor(len(launchers)) as pool:  # the nodes at once
        results = list(pool.map(lambda launcher: run_cli(*argv, launcher=launcher), launchers))
    for result in results:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return "".join(result.stdout + result.stderr for result in results)


def forked_ranks(rank, nprocs: int, root: Path, preload: tuple = ()) -> None:
    """``rank(r, port, str(root))`` on ``nprocs`` CPU processes (gloo, their rendezvous on
    ``port``), forked from one fresh process that has imported ``preload`` once: spawned ranks
    would each cost seconds of imports on a small CPU, and a process that has run autograd, as a
    test process has, cannot fork. A rank that fails or hangs fails the caller (its stack is in
    the captured stderr)."""
    import multiprocessing

    port = free_port()
    launcher = multiprocessing.get_context("spawn").Process(
        target=_fork_ranks, args=(rank, nprocs, port, str(root), tuple(preload)))
    launcher.start()
    launcher.join(timeout=300)
    if launcher.is_alive():
        launcher.kill()
    assert launcher.exitcode == 0, "a rank failed or hung: its stack is in the captured stderr"


def _fork_ranks(rank, nprocs: int, port: int, root: str, preload: tuple) -> None:
    """(In the fresh process of :func:`forked_ranks`.)"""
    import importlib

    import torch.multiprocessing as mp

    for name in preload:
        importlib.import_module(name)
    mp.start_processes(rank, args=(port, root), nprocs=nprocs, start_method="fork")


def run_main_logged(capsys, argv):
    """:func:`run_main` from the repository's root, with the log lines the process would print
    on stderr: (exit status, stdout + stderr + log lines)."""
    with _at_root_with_log_lines() as lines:
        code, out, err = run_main(capsys, argv)
    return code, "\n".join([out, err, *lines])


def run_here(*argv):
    """:func:`run_main_logged` without pytest's ``capsys`` (a module-scoped fixture's run):
    ``python -m fp8_lightning ARGV`` in this process, for the runs whose process is not what is
    tested (no Python, Lightning or data-loader forkserver to start: seconds each on a small
    CPU). (exit status, stdout + stderr + log lines)."""
    import io

    printed = io.StringIO()
    with _at_root_with_log_lines() as lines, contextlib.redirect_stdout(printed), \
            contextlib.redirect_stderr(printed):
        code = _main_status(argv)
    return code, "\n".join([printed.getvalue(), *lines])


@contextlib.contextmanager
def _at_root_with_log_lines():
    """In the repository's root, collecting the log lines a process would print on stderr."""
    import logging

    class Lines(logging.Handler):  # the log lines a process would print on stderr
        def emit(self, record):
            if record not in records:  # (one record can reach two of the loggers below)
                records.append(record)
                lines.append(self.format(record))

    # Lightning's loggers may not propagate to the root (it gives them a handler of their
    # own when it is imported before the root has one): listen to each
    loggers = [logging.getLogger(name) for name in ("", "lightning.pytorch",
                                                    "lightning.fabric", "fp8_lightning")]
    records, lines, handler, cwd = [], [], Lines(logging.INFO), os.getcwd()
    for logger in loggers:
        logger.addHandler(handler)
    os.chdir(ROOT)
    try:
        yield lines
    finally:
        os.chdir(cwd)
        for logger in loggers:
            logger.removeHandler(handler)


def rank_settings(root):
    """What ``tests.helpers.StrategySettings`` wrote of the strategy, one dict per rank."""
    return [{k: v for k, v in rank.items() if k != "layout"} for rank in _settings(root)]


def rank_layouts(root):
    """Where each rank ran (``tests.helpers.StrategySettings``' layout), in global rank order."""
    return [rank["layout"] for rank in _settings(root)]


def _settings(root):
    import json

    return [json.loads(p.read_text()) for p in sorted((root / "settings").glob("rank*.json"))]
