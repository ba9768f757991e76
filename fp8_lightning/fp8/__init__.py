"""FP8 as a component applied to the model, not woven through it.

One job per file:

* :mod:`.recipes`: the recipe registry (engine, fields and defaults, scaling state) and its
  validation; a new recipe is one entry.
* :mod:`.policy`: the layer policy, the one filter that keeps modules BF16.
* :mod:`.engine`: what an engine does; :mod:`.te_engine` (TransformerEngine modules) and
  :mod:`.torchao_engine` (PyTorch-native float8 in the PyTorch layers) do it.
* :mod:`.plugin`: the precision plugin (``FP8Precision``; Fabric's form in
  :mod:`fp8_lightning.fabric`), the fallback to BF16 and :func:`fp8_plugin`, the accessor.
* :mod:`.scaling_state`: TE's delayed-scaling state in checkpoints, as plain tensors.
* :mod:`.stats`: the ``FP8Stats`` callback (amax, scales, underflows through TE's debug API).
"""

from .engine import Engine
from .engines import get_engine
from .plugin import FP8Precision, FP8PrecisionBase, FP8UnavailableError, fp8_plugin
from .policy import bf16_module_names, find_gpt, gemm_dims_ok
from .recipes import BACKEND, ENGINES, RECIPES, REMOVED_KEYS, Recipe, build_recipe_config, recipe_names
from .scaling_state import export_fp8_scaling, import_fp8_scaling, te_modules
from .te_engine import fp8_modules_ran, make_te_recipe, recipe_available, te_gemm_modules

__all__ = ["BACKEND", "ENGINES", "Engine", "FP8Precision", "FP8PrecisionBase", "FP8UnavailableError",
           "RECIPES", "REMOVED_KEYS", "Recipe", "bf16_module_names", "build_recipe_config",
           "export_fp8_scaling", "find_gpt", "fp8_modules_ran", "fp8_plugin", "gemm_dims_ok",
           "get_engine", "import_fp8_scaling", "make_te_recipe", "recipe_available",
           "recipe_names", "te_gemm_modules", "te_modules"]
