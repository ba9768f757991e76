"""TransformerEngine availability, asked once and answered with a reason.

TransformerEngine is an optional dependency (``pip install "fp8-lightning[te]"``). Everything
that needs it goes through :func:`te_status` so that a missing or broken install becomes a
reason in the log, never an ``ImportError`` in the middle of a run.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from lightning_utilities.core.imports import RequirementCache

TE_REQUIREMENT = RequirementCache("transformer_engine>=2.0")
# FP8 tensor cores: Ada (sm_89), Hopper (sm_90), Blackwell (sm_100+).
MIN_FP8_CAPABILITY = (8, 9)


@functools.lru_cache(maxsize=None)
def te_status() -> tuple[bool, str]:
    """(importable, reason) for ``transformer_engine.pytorch``."""
    if not TE_REQUIREMENT:
        return False, ("TransformerEngine is not installed (on a GPU machine: "
                       'pip install "fp8-lightning[te]")')
    if not torch.cuda.is_available():
        return False, "no CUDA GPU is visible (TransformerEngine needs one)"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # a broken build raises anything from OSError to RuntimeError
        return False, f"TransformerEngine failed to import: {type(err).__name__}: {err}"
    return True, "TransformerEngine " + te_version()


def te_available() -> bool:
    return te_status()[0]


def te_module() -> Any:
    """``transformer_engine.pytorch``; raises with the reason when it cannot be used."""
    ok, reason = te_status()
    if not ok:
        raise RuntimeError(reason)
    import transformer_engine.pytorch as te

    return te


def te_version() -> str:
    try:
        from importlib.metadata import version

        return version("transformer_engine")
    except Exception:
        return "not installed"


def gpu_fp8_capable() -> tuple[bool, str]:
    """Whether the current GPU has FP8 tensor cores, with a reason."""
    if not torch.cuda.is_available():
        return False, "no CUDA GPU is visible"
    cap = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    if cap < MIN_FP8_CAPABILITY:
        return False, (f"{name} has compute capability {cap[0]}.{cap[1]}; FP8 needs "
                       f">= {MIN_FP8_CAPABILITY[0]}.{MIN_FP8_CAPABILITY[1]} (Ada, Hopper, Blackwell)")
    return True, f"{name} (sm_{cap[0]}{cap[1]})"
