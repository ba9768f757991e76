"""fp8-lightning: FP8 training of GPT-style models with TransformerEngine, as a Lightning run."""

from .checkpoint import AtomicCheckpointIO, Checkpoint, CheckpointError
from .config import PRESETS, ConfigError, GPTConfig
from .distributed import FSDP2Strategy
from .fp8 import FP8Precision
from .fp8_stats import FP8Stats
from .model import GPT
from .monitor import TrainingMonitor
from .safety import FaultInjection, NaNGuard, NonFiniteTrainingError

__version__ = "0.1.0"
__all__ = ["AtomicCheckpointIO", "Checkpoint", "CheckpointError", "ConfigError", "FP8Precision",
           "FP8Stats", "FSDP2Strategy", "FaultInjection", "GPT", "GPTConfig", "NaNGuard", "NonFiniteTrainingError",
           "PRESETS", "TrainingMonitor", "__version__"]
