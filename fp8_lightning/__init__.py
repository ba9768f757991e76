"""fp8-lightning: FP8 training of GPT-style models with TransformerEngine, as a Lightning run."""

from .config import PRESETS, ConfigError, GPTConfig
from .fp8 import FP8Precision
from .model import GPT

__version__ = "0.1.0"
__all__ = ["FP8Precision", "GPT", "GPTConfig", "ConfigError", "PRESETS", "__version__"]
