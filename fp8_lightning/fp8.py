"""FP8 as a component: the recipe, the layer policy, and the Lightning precision plugin.

* :func:`build_recipe_config` validates a recipe and its fields (TE's recipe classes silently
  accept misspelled keywords; this does not).
* :func:`bf16_module_names` is the layer policy: the one place that decides which modules stay
  BF16 (LM head, first/last N blocks, any GEMM whose dims FP8 cannot take).
* :class:`FP8PrecisionBase` owns ``te.autocast``, the recipe, the FP8-active switch, its history
  and the FP8 scaling state in checkpoints, and falls back to BF16 with a reason. Two thin forms
  drive it: :class:`FP8Precision` for the Lightning Trainer, and
  :class:`~fp8_lightning.fabric.FabricFP8Precision` for ``lightning.Fabric``.

Checkpoint policy for FP8 scaling state (TE >= 2.18 refuses to unpickle ``_extra_state`` without
``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``): this plugin never writes pickles. When it saves, every
TE module's ``_extra_state`` is replaced by an empty tensor and the delayed-scaling amax history and
scales are stored as plain tensors in the plugin's own state (loadable with
``torch.load(weights_only=True)``); when it loads, it copies them back through TE's
``reset_fp8_meta_tensors``. A foreign checkpoint's pickled extra state is dropped with a warning
(the scales recalibrate within ``amax_history_len`` steps) unless the user set the TE variable
themselves, in which case TE loads it as TE would.
"""

from __future__ import annotations

import logging
import weakref
from contextlib import ExitStack, contextmanager
from typing import Any, Generator, Literal, Optional

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import nn
from typing_extensions import override

from .config import FP8_MULTIPLE, ConfigError
from .te_support import fallback_precision, gpu_fp8_capable, te_module, te_status

log = logging.getLogger(__name__)


def _warn(message: str) -> None:
    """One WARNING line, on rank zero only."""
    if rank_zero_only.rank == 0:
        log.warning(message)

# Fields each recipe takes, with defaults. The TE class is looked up by name at build time.
RECIPES: dict[str, tuple[str, dict[str, Any]]] = {
    "delayed": ("DelayedScaling", dict(fp8_format="hybrid", margin=0, amax_history_len=1024,
                                       amax_compute_algo="max", reduce_amax=True, fp8_dpa=False)),
    "current": ("Float8CurrentScaling", dict(fp8_format="hybrid", fp8_dpa=False)),
    "block": ("Float8BlockScaling", dict(fp8_format="e4m3")),
    "mxfp8": ("MXFP8BlockScaling", dict(fp8_format="e4m3", margin=0)),
}
# fp8_dpa: attention itself (cuDNN, ``model.attention: te``) in FP8; a beta feature of TE.
FORMATS = ("hybrid", "e4m3")  # E5M2-only training is not supported by TE
REMOVED_KEYS = {
    "interval": "removed in TransformerEngine 2.x (scales are updated every step)",
    "override_linear_precision": "removed in TransformerEngine 2.x",
}


def build_recipe_config(recipe: str, **fields: Any) -> dict[str, Any]:
    """Validate ``recipe`` and its fields; ``None`` means the recipe's default.

    Returns a plain dict (``{"recipe": name, field: value, ...}``) that goes into checkpoints.
    """
    problems = []
    if recipe not in RECIPES:
        raise ConfigError([f"recipe={recipe!r}; valid: {', '.join(RECIPES)}"], "FP8 recipe")
    _, defaults = RECIPES[recipe]
    config: dict[str, Any] = {"recipe": recipe, **defaults}
    for key, value in fields.items():
        if value is None:
            continue
        if key in REMOVED_KEYS:
            problems.append(f"{key}: {REMOVED_KEYS[key]}; valid fields for recipe={recipe!r}: "
                            f"{', '.join(defaults)}")
        elif key not in defaults:
            problems.append(f"{key} is not a field of recipe={recipe!r}; valid: "
                            f"{', '.join(defaults)}")
        else:
            config[key] = value
    fmt = config["fp8_format"]
    if fmt not in FORMATS:
        problems.append(f"fp8_format={fmt!r}; valid: {', '.join(FORMATS)} (E5M2-only training "
                        "is not supported)")
    elif recipe == "block" and fmt != "e4m3":
        problems.append(f"fp8_format={fmt!r} with recipe='block'; valid: e4m3")
    if "amax_compute_algo" in config and config["amax_compute_algo"] not in ("max", "most_recent"):
        problems.append(f"amax_compute_algo={config['amax_compute_algo']!r}; valid: max, most_recent")
    if "amax_history_len" in config and not (isinstance(config["amax_history_len"], int)
                                             and config["amax_history_len"] >= 1):
        problems.append(f"amax_history_len={config['amax_history_len']!r} must be an integer >= 1")
    if "margin" in config and not (isinstance(config["margin"], int) and config["margin"] >= 0):
        problems.append(f"margin={config['margin']!r} must be an integer >= 0")
    if problems:
        raise ConfigError(problems, "FP8 recipe")
    return config


def make_te_recipe(config: dict[str, Any]) -> Any:
    """The TransformerEngine recipe object for a validated config."""
    from transformer_engine.common import recipe as te_recipe

    cls_name, _ = RECIPES[config["recipe"]]
    kwargs = {k: v for k, v in config.items() if k != "recipe"}
    kwargs["fp8_format"] = getattr(te_recipe.Format, kwargs["fp8_format"].upper())
    return getattr(te_recipe, cls_name)(**kwargs)


def recipe_available(recipe: str) -> tuple[bool, str]:
    """Can ``recipe`` run here? Asks TE itself (``is_*_available(return_reason=True)``)."""
    ok, reason = te_status()
    if not ok:
        return False, reason
    ok, gpu = gpu_fp8_capable()
    if not ok:
        return False, gpu
    te = te_module()
    check = {"delayed": te.is_fp8_available, "current": te.is_fp8_available,
             "block": te.is_fp8_block_scaling_available, "mxfp8": te.is_mxfp8_available}[recipe]
    ok, reason = check(return_reason=True)
    if not ok:
        return False, reason or f"TransformerEngine says recipe {recipe!r} is not supported on {gpu}"
    return True, gpu


def te_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Named TE modules that carry FP8 metadata (GEMM modules and ``DotProductAttention``)."""
    if not te_status()[0]:
        return {}
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    return {name: m for name, m in model.named_modules()
            if isinstance(m, TransformerEngineBaseModule)}


def te_gemm_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Named TE modules that run GEMMs (and so can run FP8)."""
    modules = te_modules(model)
    if not modules:
        return {}
    attention = te_module().DotProductAttention
    return {name: m for name, m in modules.items() if not isinstance(m, attention)}


def _gemm_dims_ok(module: nn.Module) -> bool:
    return all(p.shape[0] % FP8_MULTIPLE == 0 and p.shape[1] % FP8_MULTIPLE == 0
               for p in module.parameters(recurse=False) if p.ndim == 2)


def bf16_module_names(model: nn.Module, *, fp8_lm_head: bool, bf16_first_layers: int,
                      bf16_last_layers: int) -> dict[str, str]:
    """The layer policy: ``{module name: why it stays BF16}``.

    A module under ``blocks.<i>`` is a transformer block; ``lm_head`` is the LM head. Everything
    else that TE runs goes FP8 when its GEMM dims are multiples of 16.
    """
    keep: dict[str, str] = {}
    blocks = getattr(model, "blocks", [])
    n = len(blocks)
    for i in range(n):
        if i < bf16_first_layers:
            keep[f"blocks.{i}"] = f"bf16_first_layers={bf16_first_layers}"
        elif i >= n - bf16_last_layers:
            keep[f"blocks.{i}"] = f"bf16_last_layers={bf16_last_layers}"
    if not fp8_lm_head and hasattr(model, "lm_head"):
        keep["lm_head"] = "fp8_lm_head=false"
    for name, module in te_gemm_modules(model).items():
        if not _gemm_dims_ok(module) and not any(name.startswith(k + ".") or name == k for k in keep):
            keep[name] = f"GEMM dims not multiples of {FP8_MULTIPLE}"
    return keep


def _find_gpt(module: nn.Module) -> nn.Module:
    """The GPT inside a LightningModule (``.model``) or the module itself."""
    inner = getattr(module, "model", None)
    return inner if isinstance(inner, nn.Module) else module


class FP8UnavailableError(RuntimeError):
    """FP8 was required (``on_unavailable: error``) but cannot run here; the message says why."""


class FP8PrecisionBase(FabricPrecision):
    """FP8 training with TransformerEngine, falling back to BF16 with a reason: the logic that
    :class:`FP8Precision` (Trainer) and ``FabricFP8Precision`` (Fabric) share. Use one of those.

    Why two classes and not one: Lightning's two ``Precision`` bases give the same hook names
    different signatures (the Trainer's ``pre_backward``/``backward``/``post_backward``/
    ``optimizer_step`` take the LightningModule and a closure and call the Trainer's hooks;
    Fabric's take a plain module or ``None``). Fabric's connector accepts any Fabric ``Precision``,
    and the Trainer's is one, so a Trainer plugin is accepted by ``Fabric`` and then fails at the
    first ``fabric.backward``. Everything FP8 lives here, on Fabric's base; each form only adds the
    hooks of its loop.

    Args:
        recipe: ``delayed`` (fastest on Hopper), ``current``, ``block`` (per-block scales, more
            robust) or ``mxfp8`` (Blackwell).
        fp8_format: ``hybrid`` (E4M3 forward, E5M2 gradients) or ``e4m3``.
        margin: delayed/mxfp8: scale margin (powers of two).
        amax_history_len: delayed: amax history window.
        amax_compute_algo: delayed: ``max`` or ``most_recent``.
        reduce_amax: delayed: reduce amax across the data-parallel group.
        weights: ``bf16-mixed`` (fp32 master weights, BF16 autocast) or ``bf16-true``.
        fp8_dpa: attention in FP8 too (delayed, current; needs ``model.attention: te``; a beta
            feature of TransformerEngine; default off).
        fp8_eval: run validation/test/predict in FP8 too (default BF16).
        fp8_lm_head: run the LM head in FP8 (default BF16).
        bf16_first_layers: the first N transformer blocks stay BF16.
        bf16_last_layers: the last N transformer blocks stay BF16.
        on_unavailable: ``fallback`` (BF16 with a warning) or ``error``.
    """

    def __init__(self, recipe: Literal["delayed", "current", "block", "mxfp8"] = "delayed",
                 fp8_format: Optional[Literal["hybrid", "e4m3"]] = None,
                 margin: Optional[int] = None, amax_history_len: Optional[int] = None,
                 amax_compute_algo: Optional[Literal["max", "most_recent"]] = None,
                 reduce_amax: Optional[bool] = None, fp8_dpa: Optional[bool] = None,
                 weights: Literal["bf16-mixed", "bf16-true"] = "bf16-mixed",
                 fp8_eval: bool = False, fp8_lm_head: bool = False, bf16_first_layers: int = 0,
                 bf16_last_layers: int = 0,
                 on_unavailable: Literal["fallback", "error"] = "fallback") -> None:
        problems = []
        if weights not in ("bf16-mixed", "bf16-true"):
            problems.append(f"weights={weights!r}; valid: bf16-mixed, bf16-true")
        if on_unavailable not in ("fallback", "error"):
            problems.append(f"on_unavailable={on_unavailable!r}; valid: fallback, error")
        for key, value in (("bf16_first_layers", bf16_first_layers),
                           ("bf16_last_layers", bf16_last_layers)):
            if not isinstance(value, int) or value < 0:
                problems.append(f"{key}={value!r} must be an integer >= 0")
        if problems:
            raise ConfigError(problems, "FP8Precision")
        self.recipe_config = build_recipe_config(
            recipe, fp8_format=fp8_format, margin=margin, amax_history_len=amax_history_len,
            amax_compute_algo=amax_compute_algo, reduce_amax=reduce_amax, fp8_dpa=fp8_dpa)
        self.weights, self.precision = weights, weights
        self.fp8_eval, self.fp8_lm_head = fp8_eval, fp8_lm_head
        self.bf16_first_layers, self.bf16_last_layers = bf16_first_layers, bf16_last_layers
        self.on_unavailable = on_unavailable
        self.fp8_available = False
        self.fp8_active = False
        self.reason = "not set up yet"
        self.history: list[dict[str, Any]] = []
        self.bf16_modules: dict[str, str] = {}
        self._te_recipe: Any = None
        self._device_type = "cpu"
        self._amax_group: Any = None
        self._model_ref: Optional[weakref.ref] = None
        self._hooks: list[Any] = []
        self._verify_pending = False
        self._loaded_state: Optional[dict[str, Any]] = None  # loaded before set-up: applied there
        self.scaling_restored = 0  # TE modules whose delayed-scaling state came from a checkpoint

    # ----------------------------------------------------------------------------- status
    @property
    def effective_precision(self) -> str:
        """What really runs: ``fp8-<recipe>``, ``bf16`` or (a CPU without BF16) ``fp32``."""
        if self.fp8_active:
            return f"fp8-{self.recipe_config['recipe']}"
        return "fp32" if self.precision == "32-true" else "bf16"

    @property
    def tag(self) -> str:
        """Short tag for log lines: ``FP8 delayed`` or ``BF16 (fallback: <reason>)``."""
        if self.fp8_active:
            return f"FP8 {self.recipe_config['recipe']}"
        return f"{self.effective_precision.upper()} (fallback: {self.reason})"

    def _record(self, event: str, reason: str, step: Optional[int] = None) -> None:
        self.history.append({"event": event, "reason": reason, "step": step,
                             "precision": self.effective_precision})

    @property
    def model(self) -> Optional[nn.Module]:
        return self._model_ref() if self._model_ref is not None else None

    # ----------------------------------------------------------------------------- setup
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        gpt = _find_gpt(module)
        n_layer = len(getattr(gpt, "blocks", []))
        too_many = [f"{key}={value} is more than the model's {n_layer} blocks"
                    for key, value in (("bf16_first_layers", self.bf16_first_layers),
                                       ("bf16_last_layers", self.bf16_last_layers))
                    if value > n_layer]
        if too_many:
            raise ConfigError(too_many + [f"valid: 0 to {n_layer}"], "FP8Precision")
        self._model_ref = weakref.ref(gpt)
        # Decided once here, not on every step: the strategy has set up devices and process
        # groups before it converts the module.
        self._device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self._amax_group = _data_parallel_group()
        ok, reason = recipe_available(self.recipe_config["recipe"])
        if ok and not te_gemm_modules(gpt):
            ok, reason = False, ("the model has no TransformerEngine layers (backend=torch); "
                                 "use model.backend: auto or te")
        self.fp8_available = ok
        if not ok:
            if self.on_unavailable == "error":
                raise FP8UnavailableError(f"FP8 is not available: {reason}; "
                                          "on_unavailable=error, stopping.")
            # The fastest precision this hardware really has: BF16 emulated on a CPU without
            # BF16 instructions is several times slower than FP32.
            fallback, why = fallback_precision()
            if fallback == "32-true":
                self.precision = "32-true"
            _warn(f"FP8 is not available: {reason}. Running {why}.")
            self.fp8_active, self.reason = False, f"{reason}; {why}"
            self._record("unavailable", reason)
        if self.precision == "bf16-true":
            module = module.to(torch.bfloat16)
        if not ok:
            self._apply_loaded_state()
            return module
        self._te_recipe = make_te_recipe(self.recipe_config)
        self._remove_hooks()  # set up again (fit, then validate): never stack hooks twice
        self._apply_layer_policy(gpt)
        self._install_checkpoint_hooks(gpt)
        self.fp8_active, self.reason = True, reason
        self._verify_pending = True
        self._record("enabled", f"{reason}; recipe {self.recipe_config}")
        log.info("FP8 %s on %s; BF16 modules: %s", self.recipe_config["recipe"], reason,
                 ", ".join(f"{k} ({v})" for k, v in self.bf16_modules.items()) or "none")
        self._apply_loaded_state()
        return module

    def _apply_layer_policy(self, gpt: nn.Module) -> None:
        te = te_module()
        self.bf16_modules = bf16_module_names(gpt, fp8_lm_head=self.fp8_lm_head,
                                              bf16_first_layers=self.bf16_first_layers,
                                              bf16_last_layers=self.bf16_last_layers)
        modules = dict(gpt.named_modules())
        for name in self.bf16_modules:
            active: list[Any] = []  # the open te.autocast(enabled=False) region of this module

            def enter(_mod, _args, active=active):
                region = te.autocast(enabled=False)
                region.__enter__()
                active.append(region)

            def leave(_mod, _args, _out, active=active):
                if active:
                    active.pop().__exit__(None, None, None)

            target = modules[name]
            self._hooks.append(target.register_forward_pre_hook(enter))
            self._hooks.append(target.register_forward_hook(leave, always_call=True))

    def _install_checkpoint_hooks(self, gpt: nn.Module) -> None:
        for module in te_modules(gpt).values():
            self._hooks.append(module.register_state_dict_post_hook(_strip_extra_state))
            self._hooks.append(module.register_load_state_dict_pre_hook(_drop_foreign_extra_state))

    # ----------------------------------------------------------------------------- contexts
    @contextmanager
    def _context(self, fp8: bool) -> Generator[None, None, None]:
        with ExitStack() as stack:
            if self.precision == "bf16-mixed":
                stack.enter_context(torch.autocast(self._device_type, dtype=torch.bfloat16))
            if self._te_recipe is not None:
                stack.enter_context(te_module().autocast(
                    enabled=fp8 and self.fp8_active, recipe=self._te_recipe,
                    amax_reduction_group=self._amax_group))
            yield

    @contextmanager
    def _training_context(self) -> Generator[None, None, None]:
        """A training forward in FP8; after the first FP8 step, checks that FP8 really ran."""
        with self._context(fp8=True):
            yield
        if self._verify_pending and self.fp8_active:
            self._verify_fp8_ran()

    def _verify_fp8_ran(self) -> None:
        """After the first FP8 step: did any TE module really run FP8? If not, say so."""
        self._verify_pending = False
        ran = fp8_modules_ran(self.model)
        if not ran:
            self.disable_fp8("no TransformerEngine module ran FP8 in the first step")
        else:
            log.info("FP8 verified: %d TE modules ran FP8 in the first step", len(ran))

    # ----------------------------------------------------------------------------- switch
    def disable_fp8(self, reason: str, step: Optional[int] = None) -> None:
        """Run BF16 from now on (until :meth:`enable_fp8`)."""
        if not self.fp8_active:
            return
        self.fp8_active, self.reason = False, reason
        self._record("disabled", reason, step)
        _warn(f"FP8 disabled{'' if step is None else f' at step {step}'}: {reason}. "
              "Training continues in BF16.")

    def enable_fp8(self, reset_scaling: bool = True, step: Optional[int] = None) -> bool:
        """Return to FP8 (with fresh scaling state by default); False if FP8 cannot run here."""
        if self.fp8_active:
            return True
        if not self.fp8_available:
            return False
        if reset_scaling and self.model is not None:
            for module in te_modules(self.model).values():
                module.reset_fp8_meta_tensors()
        self.fp8_active, self.reason = True, "re-enabled"
        self._verify_pending = True
        self._record("enabled", f"re-enabled (reset_scaling={reset_scaling})", step)
        log.info("FP8 re-enabled%s", "" if step is None else f" at step {step}")
        return True

    # ----------------------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        state = {"recipe": dict(self.recipe_config), "weights": self.weights,
                 "fp8_active": self.fp8_active, "effective_precision": self.effective_precision,
                 "reason": self.reason, "history": [dict(h) for h in self.history],
                 "bf16_modules": dict(self.bf16_modules)}
        if self.model is not None and self.fp8_available and self.recipe_config["recipe"] == "delayed":
            state["scaling"] = export_fp8_scaling(self.model)  # the only stateful recipe
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("recipe", {})
        if saved and saved != self.recipe_config:
            log.info("checkpoint was trained with FP8 recipe %s; this run uses %s", saved,
                     self.recipe_config)
        self.history = list(state_dict.get("history", [])) + self.history
        self._loaded_state = state_dict
        # Not set up yet (Fabric: fabric.load before fabric.setup): the switch and the scaling
        # state need the converted model, so convert_module applies them.
        if self._model_ref is not None or self.fp8_active:
            self._apply_loaded_state()

    def _apply_loaded_state(self) -> None:
        """The loaded switch state and FP8 scaling state, once the model is set up."""
        state_dict, self._loaded_state = self._loaded_state, None
        if state_dict is None:
            return
        saved = state_dict.get("recipe", {})
        # The checkpoint's own last event, not this run's (set-up has recorded "enabled" by now).
        last = (state_dict.get("history") or [{}])[-1]
        if self.fp8_active and not state_dict.get("fp8_active", True) and \
                last.get("event") == "disabled":
            self.disable_fp8(f"restored from checkpoint: {last.get('reason')}")
        scaling = state_dict.get("scaling")
        if scaling and self.fp8_active and self.model is not None:
            if saved.get("recipe") == self.recipe_config["recipe"] == "delayed":
                self.scaling_restored = import_fp8_scaling(self.model, scaling, self._te_recipe)
            else:
                log.info("FP8 scaling state in the checkpoint (%s) not used by recipe %s",
                         saved.get("recipe"), self.recipe_config["recipe"])

    def _remove_hooks(self) -> None:
        # Not done in teardown(): a checkpoint saved after fit (trainer.save_checkpoint) must
        # still go through the extra-state hooks.
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


class FP8Precision(FP8PrecisionBase, Precision):
    """The FP8 precision plugin for the Lightning Trainer (``Trainer(plugins=[FP8Precision()])``).

    Arguments and behaviour: :class:`FP8PrecisionBase`. Training steps run FP8; validation, test
    and predict run BF16 unless ``fp8_eval``. For ``lightning.Fabric`` use
    :class:`~fp8_lightning.fabric.FabricFP8Precision` (same arguments).
    """

    @override
    def forward_context(self) -> Any:
        return self._context(fp8=True)

    @override
    def train_step_context(self) -> Any:
        return self._training_context()

    @override
    def val_step_context(self) -> Any:
        return self._context(fp8=self.fp8_eval)

    @override
    def test_step_context(self) -> Any:
        return self._context(fp8=self.fp8_eval)

    @override
    def predict_step_context(self) -> Any:
        return self._context(fp8=self.fp8_eval)

    @override
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        # Fabric accepts this plugin (it is a Fabric Precision too) and calls this hook with its
        # own module or None, where the Trainer's form needs module.trainer: say what to use.
        if getattr(module, "_trainer", None) is None:
            raise TypeError("FP8Precision is the Lightning Trainer's plugin and cannot drive "
                            "lightning.Fabric's backward; with Fabric use "
                            "fp8_lightning.fabric.FabricFP8Precision (same arguments)")
        return super().pre_backward(tensor, module)


def _data_parallel_group() -> Any:
    """The group delayed scaling reduces amax over: every data-parallel rank."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        return torch.distributed.group.WORLD
    return None


def fp8_modules_ran(model: Optional[nn.Module]) -> list[str]:
    """TE modules whose last forward ran FP8 (TE sets ``module.fp8`` on every forward)."""
    if model is None:
        return []
    return [name for name, m in te_gemm_modules(model).items() if getattr(m, "fp8", False)]


def export_fp8_scaling(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Delayed-scaling state of every TE module as plain tensors (no pickle)."""
    out = {}
    for name, module in te_modules(model).items():
        tensors = module.get_fp8_meta_tensors()
        if not tensors or "num_gemms" not in module.fp8_meta:
            continue
        out[name] = {"num_gemms": int(module.fp8_meta["num_gemms"]),
                     "scale_fwd": tensors["scaling_fwd"][0].cpu(),
                     "amax_history_fwd": tensors["scaling_fwd"][1].cpu(),
                     "scale_bwd": tensors["scaling_bwd"][0].cpu(),
                     "amax_history_bwd": tensors["scaling_bwd"][1].cpu()}
    return out


def import_fp8_scaling(model: nn.Module, scaling: dict[str, dict[str, Any]], recipe: Any) -> int:
    """Copy exported delayed-scaling tensors back into TE modules; returns modules restored."""
    restored, skipped = 0, []
    modules = te_modules(model)
    for name, saved in scaling.items():
        module = modules.get(name)
        if module is None or saved["amax_history_fwd"].shape[0] != recipe.amax_history_len:
            skipped.append(name)
            continue
        module.fp8_meta["num_gemms"] = saved["num_gemms"]
        module.fp8_meta["recipe"] = recipe
        module.fp8_meta["fp8_checkpoint"] = True
        current = module.fp8_meta.get("scaling_fwd")
        if current is None or current.amax_history.shape != saved["amax_history_fwd"].shape:
            module.init_fp8_meta_tensors(recipe)
        # else copied in place below: captured CUDA graphs keep pointing at these tensors
        module.reset_fp8_meta_tensors({
            "scaling_fwd": [saved["scale_fwd"], saved["amax_history_fwd"]],
            "scaling_bwd": [saved["scale_bwd"], saved["amax_history_bwd"]]})
        restored += 1
    if skipped:
        log.warning("FP8 scaling state not restored for %d module(s) (missing or different "
                    "amax_history_len): %s; they recalibrate", len(skipped), ", ".join(skipped[:5]))
    log.info("FP8 scaling state restored for %d TE modules", restored)
    return restored


def _strip_extra_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook: no pickled TE extra state in our checkpoints (the plugin stores it)."""
    key = prefix + "_extra_state"
    if key in state_dict:
        state_dict[key] = torch.empty(0, dtype=torch.uint8)


def _drop_foreign_extra_state(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """Load pre-hook: a pickled extra state we did not write is dropped unless the user opted in."""
    from transformer_engine.pytorch._extra_state import (UNSAFE_PICKLE_EXTRA_STATE_ENV,
                                                          unsafe_pickle_extra_state_enabled)

    key = prefix + "_extra_state"
    value = state_dict.get(key)
    if isinstance(value, torch.Tensor) and value.numel() > 0 and not unsafe_pickle_extra_state_enabled():
        state_dict[key] = torch.empty(0, dtype=torch.uint8)
        _warn(f"{prefix.rstrip('.')}: ignoring pickled FP8 extra state from a checkpoint "
              f"not written by fp8-lightning (unsafe to unpickle); the FP8 scales "
              f"recalibrate. Set {UNSAFE_PICKLE_EXTRA_STATE_ENV}=1 only if you trust it.")
