"""fp8-lightning: FP8 training of GPT-style models with TransformerEngine, as a Lightning run."""

# The one version source: pyproject.toml reads it (setuptools dynamic version, statically).
__version__ = "0.1.0"

from .checkpoint import AtomicCheckpointIO, Checkpoint, CheckpointError  # noqa: E402
from .config import PRESETS, ConfigError, GPTConfig  # noqa: E402
from .data import TokenShardDataModule, prepare  # noqa: E402
from .distributed import FSDP2Strategy  # noqa: E402
from .fabric import FabricFP8Precision, FabricNaNGuard  # noqa: E402
from .fp8 import FP8Precision  # noqa: E402
from .fp8.stats import FP8Stats  # noqa: E402
from .model import GPT  # noqa: E402
from .module import GPTLightningModule  # noqa: E402
from .monitor import TrainingMonitor  # noqa: E402
from .safety import FaultInjection, NaNGuard, NonFiniteTrainingError  # noqa: E402

__all__ = ["FabricFP8Precision", "FabricNaNGuard", "AtomicCheckpointIO", "Checkpoint", "CheckpointError", "ConfigError", "FP8Precision",
           "FP8Stats", "FSDP2Strategy", "FaultInjection", "GPT", "GPTConfig", "GPTLightningModule",
           "NaNGuard", "NonFiniteTrainingError", "PRESETS", "TokenShardDataModule",
           "TrainingMonitor", "__version__", "prepare"]
