"""FP8 as a component applied to the model, not woven through it.

One job per file:

* :mod:`.recipes`: the recipe registry (engine, fields and defaults, scaling state) and its
  validation; a new recipe is one entry.
* :mod:`.policy`: the layer policy, the one filter that keeps modules BF16.
* :mod:`.engine`: what an engine does; :mod:`.te_engine` (TransformerEngine modules) and
  :mod:`.torchao_engine` (PyTorch-native float8 in the PyTorch layers) do it;
  :mod:`.engine_registry` names them.
* :mod:`.plugin`: the precision plugin (``FP8Precision``; Fabric's form in
  :mod:`fp8_lightning.fabric`), the fallback to BF16 and :func:`fp8_plugin`, the accessor.
* :mod:`.converter`: what else a model gets at set-up (``FP8Precision``'s ``converter``:
  :class:`fp8_lightning.Speedups` for a model this package did not build).
* :mod:`.scaling_state`: TE's delayed-scaling state in checkpoints, as plain tensors.
* :mod:`.stats`: the ``FP8Stats`` callback (amax, scales, underflows through TE's debug API).

What this package hands on is the interface: the plugin, the recipes, the layer policy and the
engines by name (what an engine does with TE or torchao stays inside it).
"""

from .converter import ModelConverter
from .engine import Engine
from .engine_registry import engine_backend, get_engine
from .gemm_timing import Gemm
from .plugin import FP8Precision, FP8PrecisionBase, FP8UnavailableError, fp8_plugin, moved_option
from .policy import bf16_module_names
from .recipes import (DEFAULT_RECIPE, ENGINES, RECIPES, REMOVED_KEYS, Recipe, RecipeName,
                      build_recipe_config, recipe_names)

__all__ = ["DEFAULT_RECIPE", "ENGINES", "Engine", "FP8Precision", "FP8PrecisionBase",
           "FP8UnavailableError", "Gemm", "ModelConverter", "RECIPES", "REMOVED_KEYS", "Recipe",
           "RecipeName", "bf16_module_names", "build_recipe_config", "engine_backend",
           "fp8_plugin", "get_engine", "moved_option", "recipe_names"]
