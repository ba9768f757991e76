"""FaultInjection (``fp8_lightning/callbacks/faults.py``): its arguments. What its faults do to a
run is the NaN guard's test (``tests/callbacks/test_guard.py``) and the GPU safety test."""

import pytest

from fp8_lightning import FaultInjection
from fp8_lightning.config import ConfigError


def test_fault_injection_arguments_are_validated():
    with pytest.raises(ConfigError, match="kind='weights'"):
        FaultInjection(kind="weights")
    with pytest.raises(ConfigError, match=r"ranks=\[-1\]\); valid: global ranks 0, 1, "):
        FaultInjection(ranks=[-1])
