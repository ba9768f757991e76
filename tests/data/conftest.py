"""A tiny prepared dataset for the prepare and streaming tests: made once per test run, copied
for each test (tests corrupt their copy)."""

import shutil

import pytest

from fp8_lightning.data.prepare import prepare
from tests._runs import shared_dir
from tests.data import TEXT_A


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    """A tiny prepared dataset (39 train / 9 val blocks of 17 tokens), made once per test run
    (``shared_dir``: the xdist processes share it); tests read it or corrupt copies."""
    def make(root):
        (root / "a.txt").write_text(TEXT_A)
        prepare([str(root / "a.txt")], str(root / "ds"), seq_len=16, val_fraction=0.2,
                num_workers=1)

    return shared_dir(tmp_path_factory, "prepared-text-a", make) / "ds"


@pytest.fixture
def dataset(prepared, tmp_path):
    shutil.copytree(prepared, tmp_path / "ds")
    return tmp_path / "ds"
