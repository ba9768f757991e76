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

# The oldest TE this code runs on: it uses te.autocast and the public
# te.is_fp8_available(return_reason=True) (transformer_engine.pytorch.quantization, which replaced
# fp8_autocast and the private fp8 module), and loads checkpoints through
# transformer_engine.pytorch._extra_state, which TE 2.18 added (with its refusal to unpickle extra
# state). An older TE would crash mid-run; below this floor the run falls back to BF16 with the
# reason, as without TE. pyproject.toml's [te] extra names the same floor.
TE_MIN_VERSION = "2.18"
TE_REQUIREMENT = RequirementCache(f"transformer_engine>={TE_MIN_VERSION}")
# FP8 tensor cores: Ada (sm_89), Hopper (sm_90), Blackwell (sm_100+).
MIN_FP8_CAPABILITY = (8, 9)


@functools.lru_cache(maxsize=None)
def te_status() -> tuple[bool, str]:
    """(importable, reason) for ``transformer_engine.pytorch``."""
    if not TE_REQUIREMENT:
        found = te_version()
        if found == "not installed":
            return False, ("TransformerEngine is not installed (on a GPU machine: "
                           'pip install "fp8-lightning[te]")')
        return False, (f"TransformerEngine {found} found, >= {TE_MIN_VERSION} needed "
                       '(pip install -U "fp8-lightning[te]")')
    if not torch.cuda.is_available():
        return False, "no CUDA GPU is visible (TransformerEngine needs one)"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # a broken build raises anything from OSError to RuntimeError
        hint = ""
        if "libcudnn" in str(err):
            # TE loads a system cuDNN (CUDNN_PATH, CUDA_HOME, /usr/local/cuda) before PyTorch's
            # bundled one; an older system copy then clashes with the one PyTorch loaded
            hint = ("; a system cuDNN clashes with PyTorch's: point CUDNN_PATH at PyTorch's "
                    "(python -c \"import nvidia.cudnn; print(nvidia.cudnn.__path__[0])\") and "
                    "put its lib first on LD_LIBRARY_PATH (cuDNN opens its parts by name)")
        return False, f"TransformerEngine failed to import: {type(err).__name__}: {err}{hint}"
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


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has BF16 instructions (x86 AVX512-BF16 or AMX, Arm BF16).

    Without them PyTorch emulates BF16 autocast on the CPU: a GPT step runs several times slower
    than in fp32. torch asks cpuinfo for the x86 features; its own query is private, so a missing
    one falls back to the kernel's flag list.
    """
    cpu = getattr(torch._C, "_cpu", None)
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        query = getattr(cpu, name, None)
        if query is not None:
            try:
                if query():
                    return True
            except Exception:  # an old build without the query: read the flags below
                break
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16", "bf16"))


def fallback_precision() -> tuple[str, str]:
    """The fastest non-FP8 precision this machine really has: (Lightning precision, why)."""
    if torch.cuda.is_available():
        if torch.cuda.is_bf16_supported():
            return "bf16-mixed", "BF16 on the GPU"
        return "32-true", f"FP32: {torch.cuda.get_device_name()} has no BF16"
    if cpu_has_native_bf16():
        return "bf16-mixed", "BF16 on the CPU (it has BF16 instructions)"
    return "32-true", ("FP32 on the CPU: it has no BF16 instructions, and emulated BF16 is "
                       "several times slower")
