"""The parts of a ``fit`` config that ``bench`` and ``doctor`` read: one place for both."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import yaml

from ..config import ConfigError, GPTConfig
from ..fp8 import FP8Precision, moved_option
from ..fp8.policy import POLICY_FIELDS
from ..fp8.recipes import AMAX_HISTORIES, split_recipe
from ..measure import Variant
from .parser_messages import import_class

# --------------------------------------------------------------------------------- run config
@dataclass
class RunConfig:
    """The parts of a ``fit`` YAML that the bench and the doctor need.

    Args:
        path: the YAML file.
        model: ``model.config`` (``GPTConfig`` fields).
        batch_size: ``data.batch_size``.
        backend: ``model.backend``.
        attention: ``model.attention``.
        fp8: the ``FP8Precision`` ``init_args`` when ``trainer.plugins`` has it, else ``None``.
    """

    path: str
    model: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 8
    backend: str = "auto"
    attention: str = "sdpa"
    fp8: Optional[dict[str, Any]] = None

    def gpt_config(self, n_layer: Optional[int] = None, seq_len: Optional[int] = None) -> GPTConfig:
        """The model config, optionally cut to ``n_layer`` blocks; ``block_size`` grows to
        ``seq_len`` when that is longer."""
        valid = {f.name for f in fields(GPTConfig)}
        unknown = sorted(set(self.model) - valid)
        if unknown:
            raise ConfigError([f"model.config.{k} is not a GPTConfig field; valid: "
                               f"{', '.join(sorted(valid))}" for k in unknown], self.path)
        overrides = dict(self.model)
        if n_layer is not None:
            overrides["n_layer"] = n_layer
        config = GPTConfig(**overrides)
        if seq_len is not None and seq_len > config.block_size:
            overrides["block_size"] = seq_len
            config = GPTConfig(**overrides)
        return config


def _section(parent: dict, key: str, path: str) -> dict:
    value = parent.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError([f"{key} must be a mapping, got {type(value).__name__}"], path)
    return value.get("init_args", value) if "class_path" in value else value


def load_run_config(path: str, model: Optional[str] = None) -> RunConfig:
    """Read a ``fit`` YAML (``configs/*.yaml``) into a :class:`RunConfig`; ``model`` replaces
    its ``model.config.name`` (a preset; the config's other model fields still apply)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError([f"not valid YAML: {err}"], path) from None
    if not isinstance(raw, dict):
        raise ConfigError(["the top level must be a mapping (trainer:, model:, data:)"], path)
    model_args = _section(raw, "model", path)
    data = _section(raw, "data", path)
    trainer = _section(raw, "trainer", path)
    plugins = trainer.get("plugins") or []
    fp8 = None
    for plugin in plugins if isinstance(plugins, list) else [plugins]:
        name = plugin.get("class_path", "") if isinstance(plugin, dict) else str(plugin)
        if name.split(".")[-1] == "FP8Precision":
            fp8 = dict(plugin.get("init_args") or {}) if isinstance(plugin, dict) else {}
    config = model_args.get("config") or {}
    if isinstance(config, dict) and "class_path" in config:
        config = config.get("init_args") or {}
    if not isinstance(config, dict):
        raise ConfigError([f"model.config must be a mapping of GPTConfig fields, got {config!r}"],
                          path)
    config = dict(config, **({"name": model} if model else {}))
    return RunConfig(path=path, model=config, batch_size=data.get("batch_size", 8),
                     backend=model_args.get("backend", "auto"),
                     attention=model_args.get("attention", "sdpa"),
                     fp8=fp8)


def build_component(value: Any) -> Any:
    """A component's nested component as the object the CLI will build: ``{class_path,
    init_args}`` (or, as a value alone, a dotted class path of this package, e.g. the plugin's
    ``converter: fp8_lightning.Speedups``) constructed, its own init_args built the same way;
    anything else as it is. A class that cannot be imported is left for jsonargparse to name."""
    if isinstance(value, str) and value.startswith("fp8_lightning.") and value[-1:].isalpha():
        value = {"class_path": value}
    if not (isinstance(value, dict) and "class_path" in value):
        return value
    cls = import_class(str(value["class_path"]))
    if cls is None:
        return value
    return cls(**{k: build_component(v) for k, v in (value.get("init_args") or {}).items()})


def check_fp8_plugin(fp8: Optional[dict[str, Any]]) -> tuple[Optional[FP8Precision], list[str]]:
    """Build the config's ``FP8Precision`` (pure Python, no GPU): the plugin, or every problem
    with the field it names."""
    if fp8 is None:
        return None, []
    where = "trainer.plugins FP8Precision"
    try:
        return FP8Precision(**{k: build_component(v) for k, v in fp8.items()}), []
    except ConfigError as err:
        return None, [f"{where}: {p}" for p in err.problems]
    except TypeError as err:
        valid = list(inspect.signature(FP8Precision).parameters)
        unknown = [k for k in fp8 if k not in valid]
        return None, [f"{where}: {k}: {moved_option(k) or 'not an argument'}; valid: "
                      f"{', '.join(valid)}" for k in unknown] or [f"{where}: {err}"]


def positive_int_problems(**values: Any) -> list[str]:
    """``name=value must be a positive integer`` for each value that is not one."""
    return [f"{k}={v!r} must be a positive integer" for k, v in values.items()
            if not isinstance(v, int) or isinstance(v, bool) or v < 1]


def fp8_plugin_args(run: RunConfig, variant: Variant) -> dict[str, Any]:
    """``FP8Precision`` arguments for an FP8 variant: the config's layer policy, its recipe fields
    when the variant runs the config's recipe, and ``on_unavailable="error"``."""
    cfg = dict(run.fp8 or {})
    args: dict[str, Any] = {k: cfg[k] for k in POLICY_FIELDS if k in cfg}
    name, fields = split_recipe(cfg.get("recipe"))
    if (name or "delayed") != variant.recipe:
        fields = {}
    if variant.bf16_ends:
        args.update(bf16_first_layers=1, bf16_last_layers=1)
    if variant.fp8_attention:
        fields.update(fp8_dpa=True)
    if variant.amax_history:
        fields.update(AMAX_HISTORIES[variant.amax_history])
    if variant.fp8_head:
        args.update(fp8_lm_head=True)
    if variant.fp8_layers:
        args.update(fp8_layers=variant.fp8_layers)
    return dict(args, recipe={"name": variant.recipe, **fields}, weights="bf16-mixed",
                on_unavailable="error")
