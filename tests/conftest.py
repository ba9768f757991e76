import os
from pathlib import Path

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several test processes share the CPU (`-n auto`, one per core): one thread each, for the
    # tests in this process and the CLI subprocesses they start, instead of every process
    # spreading over every core.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _data_cache(tmp_path_factory):
    """One cache for the embedded corpus per test run (never the user's ~/.cache), shared by the
    xdist worker processes: the quickstart's dataset is prepared once (litdata's spawned workers
    make a prepare cost ~30 s of CPU), not once per process. Two processes that prepare the same
    dataset at once each publish it complete and identical (atomically, prepare's own way)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        cache = tmp_path_factory.getbasetemp().parent / "fp8l-cache"  # above every worker's own
        cache.mkdir(exist_ok=True)
    else:
        cache = tmp_path_factory.mktemp("fp8l-cache")
    old = os.environ.get("FP8L_CACHE")
    os.environ["FP8L_CACHE"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("FP8L_CACHE", None)
    else:
        os.environ["FP8L_CACHE"] = old


@pytest.fixture(scope="session")
def small_vocab(tmp_path_factory):
    """CLI arguments for a fit on a small vocabulary (see ``_runs.small_vocab``): for the fits
    whose tests are not about the tokenizer (checkpoints, resume, signals, several processes)."""
    from tests._runs import small_vocab

    return small_vocab(tmp_path_factory)


# The files with the longest runs (several-process fits, data preparation, signals) first, by
# their time on a 2-core CPU: with `-n auto --dist loadfile` a file runs in one process, and a long
# file handed out last leaves the other processes idle at the end.
LONGEST_FIRST = ("test_signals.py", "data/test_prepare.py", "test_bad_input.py",
                 "test_distributed.py", "test_readme.py", "test_fabric.py", "test_fsdp2.py",
                 "test_cli.py", "test_console.py", "test_scripts.py", "test_notebook.py",
                 "callbacks/test_checkpoint.py", "commands/test_bench.py",
                 "data/test_streaming.py", "commands/test_compare.py", "test_hsdp.py")
TESTS = Path(__file__).resolve().parent


def pytest_configure(config):
    # xdist hands out the files in the order below only if it does not reorder them itself (by
    # their number of tests, its default under --dist loadfile: a long file of 5 tests went last)
    if getattr(config.option, "loadscopereorder", False):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    from fp8_lightning.te_availability import te_status

    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item):
        path = item.path.resolve()
        return rank.get(path.relative_to(TESTS).as_posix(), len(rank)) \
            if path.is_relative_to(TESTS) else len(rank)

    items.sort(key=key)  # stable within a file

    ok, reason = te_status()
    if ok and torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
