"""The FP8 recipes, one registry entry each: which engine runs it, its fields and their defaults,
whether it keeps scaling state across steps. A new recipe is one entry here (and, for a new
engine, the engine's constructor for it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, get_args

from ..config import ConfigError


@dataclass(frozen=True)
class Recipe:
    """One FP8 recipe.

    Args:
        engine: ``te`` (TransformerEngine modules, backend ``te``) or ``torchao`` (PyTorch-native
            float8 GEMMs in the plain PyTorch layers, backend ``torch``, under ``torch.compile``).
        builds: the engine's name for it (TE's recipe class, torchao's recipe name).
        defaults: the fields the recipe takes, with their defaults.
        stateful: keeps scaling state across steps (an amax history) that checkpoints carry.
        fp8_layers: the plugin's ``fp8_layers`` when the run leaves it unset: ``all`` or
            ``auto`` (the GEMMs too small to gain stay BF16), whichever measured faster.
    """

    engine: str
    builds: str
    defaults: dict[str, Any]
    stateful: bool = False
    fp8_layers: str = "all"


# fp8_dpa: attention itself (cuDNN, ``model.attention: te``) in FP8; a beta feature of TE.
RECIPES: dict[str, Recipe] = {
    "delayed": Recipe("te", "DelayedScaling",
                      dict(fp8_format="hybrid", margin=0, amax_history_len=1024,
                           amax_compute_algo="max", reduce_amax=True, fp8_dpa=False),
                      stateful=True),
    "current": Recipe("te", "Float8CurrentScaling", dict(fp8_format="hybrid", fp8_dpa=False)),
    "block": Recipe("te", "Float8BlockScaling", dict(fp8_format="e4m3")),
    "mxfp8": Recipe("te", "MXFP8BlockScaling", dict(fp8_format="e4m3", margin=0)),
    # torchao's float8 training recipes (Float8LinearConfig.from_recipe_name): dynamic scales
    # computed from each tensor as it is cast, so nothing to carry between steps.
    # fp8_layers auto: torchao's size filter keeps GPT-2 124M's proj and fc2 BF16, which
    # measured closer to compiled BF16 than all-FP8 (docs/benchmarks.md, the two FP8 engines);
    # it passes every GEMM of the 1.3B. rowwise's filter would keep every GEMM of GPT-2 BF16.
    "tensorwise": Recipe("torchao", "tensorwise", {}, fp8_layers="auto"),
    "rowwise": Recipe("torchao", "rowwise", {}),
    "rowwise_with_gw_hp": Recipe("torchao", "rowwise_with_gw_hp", {}),
}
# The recipe names as a type: jsonargparse validates FP8Precision's recipe against it
RecipeName = Literal["delayed", "current", "block", "mxfp8", "tensorwise", "rowwise",
                     "rowwise_with_gw_hp"]
assert set(get_args(RecipeName)) == set(RECIPES), "RecipeName lists every recipe"
# An engine's recipe when none is given: its first, the fastest measured on Hopper.
DEFAULT_RECIPE = {"te": "delayed", "torchao": "tensorwise"}
# Delayed scaling's amax history, as a bench variant's suffix names it: the last step's amax alone
# (what configs/gpt2_fp8.yaml ships), or TE's default, the maximum over 1,024 steps
# (docs/convergence.md compares the two)
AMAX_HISTORIES = {"recent": {"amax_history_len": 1, "amax_compute_algo": "most_recent"},
                  "hist1024": {k: RECIPES["delayed"].defaults[k]
                               for k in ("amax_history_len", "amax_compute_algo")}}
ENGINES = tuple(DEFAULT_RECIPE)
FORMATS = ("hybrid", "e4m3")  # E5M2-only training is not supported by TE
REMOVED_KEYS = {
    "interval": "removed in TransformerEngine 2.x (scales are updated every step)",
    "override_linear_precision": "removed in TransformerEngine 2.x",
}


def recipe_names(engine: str | None = None) -> list[str]:
    """The recipes of ``engine`` (all without one)."""
    return [name for name, r in RECIPES.items() if engine in (None, r.engine)]


def split_recipe(recipe: Any) -> tuple[Any, dict[str, Any]]:
    """``FP8Precision``'s ``recipe`` (a name, or a mapping of ``name`` and the recipe's fields)
    as ``(name or None, fields)``."""
    if isinstance(recipe, Mapping):
        fields = dict(recipe)
        return fields.pop("name", None), fields
    return recipe, {}


def describe(config: dict[str, Any]) -> str:
    """``delayed``, or with the fields set away from the recipe's defaults:
    ``delayed (amax_history_len=1, amax_compute_algo=most_recent)``."""
    name = config["recipe"]
    changed = [f"{k}={v}" for k, v in config.items()
               if k != "recipe" and RECIPES[name].defaults.get(k, v) != v]
    return f"{name} ({', '.join(changed)})" if changed else name


def build_recipe_config(recipe: str, **fields: Any) -> dict[str, Any]:
    """Validate ``recipe`` and its fields; ``None`` means the recipe's default.

    Returns a plain dict (``{"recipe": name, field: value, ...}``) that goes into checkpoints.
    TE's recipe classes silently accept misspelled keywords; this does not.
    """
    problems = []
    if recipe not in RECIPES:
        raise ConfigError([f"recipe={recipe!r}; valid: {', '.join(RECIPES)}"], "FP8 recipe")
    defaults = RECIPES[recipe].defaults
    config: dict[str, Any] = {"recipe": recipe, **defaults}
    valid = ", ".join(defaults) or "none (it has no fields)"
    for key, value in fields.items():
        if value is None:
            continue
        if key in REMOVED_KEYS:
            problems.append(f"{key}: {REMOVED_KEYS[key]}; valid fields for recipe={recipe!r}: "
                            f"{valid}")
        elif key not in defaults:
            problems.append(f"{key} is not a field of recipe={recipe!r}; valid: {valid}")
        else:
            config[key] = value
    fmt = config.get("fp8_format")
    if fmt is not None and fmt not in FORMATS:
        problems.append(f"fp8_format={fmt!r}; valid: {', '.join(FORMATS)} (E5M2-only training "
                        "is not supported)")
    elif recipe == "block" and fmt != "e4m3":
        problems.append(f"fp8_format={fmt!r} with recipe='block'; valid: e4m3")
    if "amax_compute_algo" in config and config["amax_compute_algo"] not in ("max", "most_recent"):
        problems.append(f"amax_compute_algo={config['amax_compute_algo']!r}; valid: max, most_recent")
    if "amax_history_len" in config and not (isinstance(config["amax_history_len"], int)
                                             and config["amax_history_len"] >= 1):
        problems.append(f"amax_history_len={config['amax_history_len']!r} must be an integer >= 1")
    problems += [f"{key}={config[key]!r}; valid: true, false" for key in ("reduce_amax", "fp8_dpa")
                 if key in config and not isinstance(config[key], bool)]
    if "margin" in config and not (isinstance(config["margin"], int) and config["margin"] >= 0):
        problems.append(f"margin={config['margin']!r} must be an integer >= 0")
    if problems:
        raise ConfigError(problems, "FP8 recipe")
    return config
