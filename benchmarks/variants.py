"""Variants and strategies as ``fit`` overrides: a variant is one of
:func:`fp8_lightning.measure.parse_variant`'s names, whose settings are explicit (``fp8-delayed``
attends with SDPA and checkpoints nothing: ``configs/gpt2_fp8.yaml`` as shipped is
``fp8-delayed-te-attn``, the Llama FP8 configs ``fp8-delayed-te-attn-ac-mlp``); a run overrides
its config only where the variant differs from it. A tool prefix runs a variant elsewhere:
``plain:`` through ``benchmarks/plain_pytorch.py``, ``fabric:`` through
``examples/fabric_train.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


class UsageError(Exception):
    """A bad job, variant or option: one ``error:`` line, exit status 2."""


def split_tool(name: str) -> tuple[str, str]:
    """``plain:torch-compile`` -> (``plain``, ``torch-compile``); no tool: ``fit``."""
    tool, _, variant = name.rpartition(":")
    return tool or "fit", variant


def check_variant(name: str) -> Any:
    """``[TOOL:]VARIANT`` -> its ``Variant``; a name parse_variant refuses, or one its tool cannot
    run, raises :class:`UsageError`."""
    from fp8_lightning.config import ConfigError
    from fp8_lightning.measure import parse_variant

    tool, variant = split_tool(name)
    try:
        v = parse_variant(variant)
    except ConfigError as err:
        raise UsageError("; ".join(err.problems)) from None
    if tool == "plain":
        if v.backend != "torch" or v.recipe or not v.compile or v.fp32_residual is not None:
            raise UsageError(f"{name}: benchmarks/plain_pytorch.py runs torch-compile "
                             "(optionally -ac-mlp or -ac-full) only")
    elif tool == "fabric":
        if (v.recipe is None or v.attention != "sdpa" or v.bf16_ends or v.fp8_head
                or v.fp32_residual is not None or v.activation_checkpointing != "none"
                or v.fp8_layers):
            raise UsageError(f"{name}: examples/fabric_train.py runs fp8-<recipe> (optionally "
                             "-eager or -nograph) only")
    elif tool != "fit":
        raise UsageError(f"{name}: unknown tool {tool!r}; valid: plain, fabric (none: fit)")
    return v


def read_config(path: str) -> dict[str, Any]:
    """The settings of a config file that a variant sets: ``model.X``, ``model.config.X`` and
    ``plugin.X`` (``plugin.recipe`` the recipe's name, ``recipe.X`` its fields)."""
    import yaml

    data = yaml.safe_load((ROOT / path).read_text()) or {}
    model = data.get("model") or {}
    found = {f"model.{k}": v for k, v in model.items() if k != "config"}
    found.update({f"model.config.{k}": v for k, v in (model.get("config") or {}).items()})
    for plugin in (data.get("trainer") or {}).get("plugins") or []:
        if isinstance(plugin, dict) and str(plugin.get("class_path", "")).endswith("FP8Precision"):
            args = dict(plugin.get("init_args") or {})
            recipe = args.pop("recipe", None)
            fields = dict(recipe) if isinstance(recipe, dict) else {"name": recipe}
            found["plugin.recipe"] = fields.pop("name", None)
            found.update({f"plugin.{k}": v for k, v in args.items()})
            found.update({f"recipe.{k}": v for k, v in fields.items()})
    return found


# What a config leaves unset means (GPTLightningModule's, FP8Precision's defaults)
UNSET = {"model.backend": "auto", "model.attention": "sdpa", "model.compile": None,
         "model.cuda_graphs": None, "model.activation_checkpointing": "none",
         "model.config.fp32_residual": None, "plugin.recipe": None, "plugin.fp8_lm_head": False,
         "plugin.bf16_first_layers": 0, "plugin.bf16_last_layers": 0, "plugin.fp8_layers": None}


def cli_value(value: Any) -> str:
    """A value as ``fit``'s command line takes it (a mapping in YAML's flow style)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {cli_value(v)}" for k, v in value.items()) + "}"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def plugin_overrides(options: dict[str, Any]) -> list[str]:
    """``fit`` overrides of FP8Precision's options: the one place that knows where each lives
    (a recipe's own fields in ``recipe: {name: ..., field: ...}``)."""
    return [arg for key, value in options.items()
            for arg in (f"--trainer.plugins.init_args.{key}", cli_value(value))]


def variant_overrides(name: str, config: str) -> list[str]:
    """``fit`` overrides that make ``config`` run variant ``name``: only where they differ."""
    v = check_variant(name)
    wanted: dict[str, Any] = {"model.attention": v.attention,
                              "model.activation_checkpointing": v.activation_checkpointing}
    if v.recipe is None:  # an FP8 variant's backend follows its engine (the configs' auto)
        wanted["model.backend"] = v.backend
    if not v.compile:  # -eager / torch-eager; else the config's (the module's default)
        wanted["model.compile"] = False
    if (v.backend == "te" or v.recipe) and not v.graphs:  # -nograph
        wanted["model.cuda_graphs"] = False
    if v.fp32_residual is not None:
        wanted["model.config.fp32_residual"] = v.fp32_residual
    if v.recipe is not None:
        wanted.update({"plugin.recipe": v.recipe, "plugin.fp8_lm_head": v.fp8_head,
                       "plugin.bf16_first_layers": int(v.bf16_ends),
                       "plugin.bf16_last_layers": int(v.bf16_ends)})
        if v.fp8_layers:
            wanted["plugin.fp8_layers"] = v.fp8_layers
        if v.fp8_attention:
            wanted["recipe.fp8_dpa"] = True
        if v.amax_history:
            from fp8_lightning.fp8.recipes import AMAX_HISTORIES

            wanted.update({f"recipe.{k}": w for k, w in AMAX_HISTORIES[v.amax_history].items()})
    have = {**UNSET, **read_config(config)}
    changed = {k: w for k, w in wanted.items() if have.get(k) != w}
    args = [a for k, w in changed.items() if k.startswith("model.")
            for a in (f"--{k}", cli_value(w))]
    plugin = {k[len("plugin."):]: w for k, w in changed.items() if k.startswith("plugin.")}
    fields = {k[len("recipe."):]: w for k, w in changed.items() if k.startswith("recipe.")}
    if fields:  # the recipe as a mapping: the config's fields of the same recipe, and these
        kept = {k[len("recipe."):]: w for k, w in have.items()
                if k.startswith("recipe.") and have["plugin.recipe"] == v.recipe}
        plugin["recipe"] = {"name": v.recipe, **kept, **fields}
    return args + plugin_overrides(plugin)


FSDP_GRAMMAR = "fsdp[-keep|-reshard][-gN][-rN][-eager|-compiled]"


def strategy_overrides(name: str, family: str) -> list[str]:
    """A strategy's overlay and overrides: ``ddp`` (configs/ddp.yaml), ``ddp-bf16grad`` (gradients
    all-reduced in BF16), ``ddp-bN`` (N MB buckets),
    ``fsdp[-keep|-reshard][-gN][-rN][-eager|-compiled]`` (configs/fsdp.yaml, or the Llama configs'
    own FSDP2: weights kept after forward, resharded, N blocks a unit, N replicas (HSDP),
    model.compile false / true)."""
    parts = name.split("-")
    args: list[str] = []
    strategy = "--trainer.strategy.init_args"
    if parts[0] == "ddp" and family == "gpt":
        args = ["--config", "configs/ddp.yaml"]
        for part in parts[1:]:
            if part == "bf16grad":
                args += [f"{strategy}.ddp_comm_hook", "torch.distributed.algorithms.ddp_comm_hooks."
                         "default_hooks.bf16_compress_hook"]
            elif part[:1] == "b" and part[1:].isdigit() and int(part[1:]) > 0:
                args += [f"{strategy}.bucket_cap_mb", part[1:]]
            else:
                raise UsageError(f"strategy {name!r}: ddp[-bf16grad][-bN] (N MB, a whole number)")
        return args
    if parts[0] != "fsdp":
        raise UsageError(f"strategy {name!r}; valid: " + ("ddp[-bf16grad][-bN], " if family ==
                                                          "gpt" else "")
                         + FSDP_GRAMMAR)
    if family == "gpt":  # the Llama configs carry their FSDP2 strategy
        args = ["--config", "configs/fsdp.yaml"]
    for part in parts[1:]:
        if part in ("keep", "reshard"):
            args += [f"{strategy}.reshard_after_forward", cli_value(part == "reshard")]
        elif part[:1] == "g" and part[1:].isdigit() and int(part[1:]) > 0:
            args += [f"{strategy}.blocks_per_unit", part[1:]]
        elif part[:1] == "r" and part[1:].isdigit() and int(part[1:]) > 0:
            args += [f"{strategy}.replicate", part[1:]]
        elif part in ("eager", "compiled"):
            args += ["--model.compile", cli_value(part == "compiled")]
        else:
            raise UsageError(f"strategy {name!r}: {FSDP_GRAMMAR}")
    return args


