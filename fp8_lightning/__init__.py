"""fp8-lightning: FP8 training of GPT-style models with TransformerEngine, as a Lightning run."""

from .config import PRESETS, ConfigError, GPTConfig
from .fp8 import FP8Precision
from .fp8_stats import FP8Stats
from .model import GPT
from .monitor import TrainingMonitor

__version__ = "0.1.0"
__all__ = ["FP8Precision", "FP8Stats", "GPT", "GPTConfig", "ConfigError", "PRESETS",
           "TrainingMonitor", "__version__"]
