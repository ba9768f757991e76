"""fp8-lightning: FP8 training of GPT-style models with TransformerEngine, as a Lightning run."""

import importlib

# The one version source: pyproject.toml reads it (setuptools dynamic version, statically).
__version__ = "0.1.0"

# The public names and the module each lives in, imported on first use (PEP 562): importing a
# light module such as `fp8_lightning.data.documents` (in prepare's spawned workers) or the
# `fp8_lightning.__main__` of a spawned child must not import Lightning and the whole package,
# seconds per process on a small CPU.
_EXPORTS = {
    "AtomicCheckpointIO": "checkpoint_files", "CheckpointError": "checkpoint_files",
    "Checkpoint": "callbacks.checkpoint", "TrainingMonitor": "callbacks.monitor",
    "FaultInjection": "callbacks.faults", "StepProfile": "callbacks.profile",
    "NaNGuard": "callbacks.guard", "NonFiniteTrainingError": "callbacks.guard",
    "PRESETS": "config", "ConfigError": "config", "GPTConfig": "config",
    "TokenShardDataModule": "data.streaming", "prepare": "data.prepare",
    "FSDP2Strategy": "distributed",
    "FabricFP8Precision": "fabric", "FabricNaNGuard": "fabric",
    "FP8Precision": "fp8", "FP8Stats": "fp8.stats",
    "GPT": "model", "GPTLightningModule": "module", "Speedups": "speedups",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
