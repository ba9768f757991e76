import os

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _data_cache(tmp_path_factory):
    """One cache for the embedded corpus per test session (never the user's ~/.cache)."""
    cache = tmp_path_factory.mktemp("fp8l-cache")
    old = os.environ.get("FP8L_CACHE")
    os.environ["FP8L_CACHE"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("FP8L_CACHE", None)
    else:
        os.environ["FP8L_CACHE"] = old


def pytest_collection_modifyitems(config, items):
    from fp8_lightning.te_support import te_status

    ok, reason = te_status()
    if ok and torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
