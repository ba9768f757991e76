"""The precision plugin: FP8 training through an engine, falling back to BF16 with a reason.

:class:`FP8PrecisionBase` owns the recipe, the layer policy, the FP8-active switch and its history,
the checkpoint state and the fallback; the engine (:mod:`.te_engine`, :mod:`.torchao_engine`)
owns the FP8 GEMMs. Two thin forms drive it: :class:`FP8Precision` for the Lightning Trainer and
:class:`~fp8_lightning.fabric.FabricFP8Precision` for ``lightning.Fabric``. Other modules reach
the plugin through :func:`fp8_plugin`.
"""

from __future__ import annotations

import logging
import weakref
from contextlib import ExitStack, contextmanager
from typing import Any, Generator, Literal, Mapping, Optional, Union

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import nn
from typing_extensions import override

from ..config import ConfigError
from ..te_availability import fallback_precision
from .converter import ModelConverter
from .engine import Engine
from .engine_registry import get_engine
from .policy import bf16_module_names, find_blocks, find_gpt, runs_bf16
from .recipes import (DEFAULT_RECIPE, ENGINES, RECIPES, REMOVED_KEYS, RecipeName,
                      build_recipe_config, describe, recipe_names, split_recipe)

log = logging.getLogger(__name__)
_warn = rank_zero_only(log.warning)  # one WARNING line, on rank zero only


def fp8_plugin(owner: Any) -> Optional["FP8PrecisionBase"]:
    """The FP8 precision plugin of a Trainer, a Fabric, or a LightningModule attached to a
    Trainer; ``None`` when it runs without one. The one way other modules reach the plugin."""
    holder = getattr(owner, "_trainer", None) or owner  # a LightningModule -> its Trainer
    for name in ("precision_plugin", "_precision"):  # Trainer, Fabric
        plugin = getattr(holder, name, None)
        if isinstance(plugin, FP8PrecisionBase):
            return plugin
    return None


def moved_option(key: str) -> Optional[str]:
    """Where a keyword FP8Precision does not take went (a config written for an older version),
    or None."""
    if key in REMOVED_KEYS:
        return REMOVED_KEYS[key]
    if any(key in r.defaults for r in RECIPES.values()):
        return f"a field of the recipe now: recipe: {{name: delayed, {key}: ...}}"
    if key in ("cuda_graphs", "compile_blocks", "fuse_mlp", "fuse_wgrad_accumulation",
               "cudnn_attention"):
        return ("an option of the converter now, for a model of your own: converter: {class_path: "
                f"fp8_lightning.Speedups, init_args: {{{key}: ...}}}}; this package's GPT has its "
                "own: model.compile, model.cuda_graphs")
    return None


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
        recipe: a name, or a mapping of its name (``name``) and its own fields, e.g.
            ``{name: delayed, amax_history_len: 16}`` (with ``engine: auto``, the fields alone:
            the chosen recipe keeps those it has). TE (``engine: te``): ``delayed``
            (fastest on Hopper; fields ``fp8_format``, ``margin``, ``amax_history_len``,
            ``amax_compute_algo``, ``reduce_amax``, ``fp8_dpa``), ``current`` (``fp8_format``,
            ``fp8_dpa``), ``block`` (per-block scales, more robust; ``fp8_format``) or ``mxfp8``
            (Blackwell; ``fp8_format``, ``margin``); torchao (``engine: torchao``):
            ``tensorwise``, ``rowwise`` or ``rowwise_with_gw_hp``. ``fp8_dpa`` runs attention in
            FP8 too (needs ``model.attention: te``; a beta feature of TE). Default: the engine's
            first (``delayed``, ``tensorwise``) with its defaults (:mod:`.recipes`).
        engine: ``te`` (TransformerEngine modules, ``model.backend: te``), ``torchao``
            (PyTorch-native float8 in the PyTorch layers, ``model.backend: torch``, compiled) or
            ``auto`` (a few timed steps of each engine's recipes and of BF16 on this model and GPU
            pick the fastest, logged with the figures; needs ``GPTLightningModule`` and a GPU;
            ``model.backend: auto`` then follows the choice). Default: the recipe's engine, else
            ``te``.
        weights: ``bf16-mixed`` (fp32 master weights, BF16 autocast) or ``bf16-true``.
        fp8_eval: run validation/test/predict in FP8 too (default BF16).
        fp8_lm_head: run the LM head in FP8 (default BF16).
        bf16_first_layers: the first N transformer blocks stay BF16.
        bf16_last_layers: the last N transformer blocks stay BF16.
        fp8_layers: ``all`` (every GEMM the policy allows) or ``auto``: the GEMMs too small to
            gain from FP8 stay BF16, logged with why. TE engine: each distinct GEMM shape is timed
            in BF16 and in FP8 at the run's micro-batch on this GPU (a few seconds at start-up)
            and a layer whose GEMMs are not faster in FP8 stays BF16. torchao engine: torchao's
            own size filter for the recipe (torchtitan's ``auto_filter_small_kn``), per GEMM.
            Default: the recipe's measured faster one (``auto`` for ``tensorwise``, else ``all``).
        on_unavailable: ``fallback`` (BF16 with a warning) or ``error``.
        converter: what else the model gets at set-up (:class:`.converter.ModelConverter`):
            :class:`fp8_lightning.Speedups` makes a model this package did not build fast (CUDA
            graphs of its blocks, compiled blocks, fused MLPs, FP32 weight gradients, cuDNN
            attention). This package's GPT has its own (``model.compile``, ``model.cuda_graphs``).
    """

    def __init__(self, recipe: Union[RecipeName, dict[str, Any], None] = None,
                 engine: Optional[Literal["te", "torchao", "auto"]] = None,
                 weights: Literal["bf16-mixed", "bf16-true"] = "bf16-mixed",
                 fp8_eval: bool = False, fp8_lm_head: bool = False, bf16_first_layers: int = 0,
                 bf16_last_layers: int = 0,
                 fp8_layers: Optional[Literal["all", "auto"]] = None,
                 on_unavailable: Literal["fallback", "error"] = "fallback",
                 converter: Optional[ModelConverter] = None) -> None:
        problems = []
        name, fields = split_recipe(recipe)
        if isinstance(recipe, Mapping) and name is None and engine != "auto":
            # (engine auto picks the recipe; the fields it has of these are kept)
            problems.append(f"recipe={recipe!r} has no name; valid: a mapping with name: one of "
                            f"{', '.join(RECIPES)}, and that recipe's fields (the fields alone "
                            "with engine: auto)")
        if weights not in ("bf16-mixed", "bf16-true"):
            problems.append(f"weights={weights!r}; valid: bf16-mixed, bf16-true")
        if fp8_layers not in (None, "all", "auto"):
            problems.append(f"fp8_layers={fp8_layers!r}; valid: all, auto")
        if on_unavailable not in ("fallback", "error"):
            problems.append(f"on_unavailable={on_unavailable!r}; valid: fallback, error")
        if converter is not None and not isinstance(converter, ModelConverter):
            problems.append(f"converter={converter!r}; valid: a ModelConverter, e.g. "
                            "fp8_lightning.Speedups()")
        for key, value in (("bf16_first_layers", bf16_first_layers),
                           ("bf16_last_layers", bf16_last_layers)):
            if not isinstance(value, int) or value < 0:
                problems.append(f"{key}={value!r} must be an integer >= 0")
        if engine is not None and engine not in (*ENGINES, "auto"):
            problems.append(f"engine={engine!r}; valid: {', '.join(ENGINES)}, auto")
        elif engine == "auto" and name is not None:
            problems.append(f"recipe={name!r} with engine='auto', which chooses the recipe "
                            "too; leave recipe unset, or name its engine")
        elif name in RECIPES and engine not in (None, RECIPES[name].engine):
            problems.append(f"recipe={name!r} runs on engine {RECIPES[name].engine!r}; valid "
                            f"recipes for engine={engine!r}: {', '.join(recipe_names(engine))}")
        if problems:
            raise ConfigError(problems, "FP8Precision")
        self.auto = engine == "auto"  # until choose_engine() has measured
        self.auto_figures: Optional[str] = None
        self.auto_bf16: Optional[str] = None  # why BF16 won the measurement
        if name is None:
            name = DEFAULT_RECIPE["te" if engine in (None, "auto") else engine]
        self.engine: Engine = get_engine(RECIPES[name].engine if name in RECIPES else "te")
        self.recipe_config = build_recipe_config(name, **fields)
        self.weights, self.precision = weights, weights
        self.fp8_eval, self.fp8_lm_head = fp8_eval, fp8_lm_head
        self.bf16_first_layers, self.bf16_last_layers = bf16_first_layers, bf16_last_layers
        self.on_unavailable = on_unavailable
        self.converter = converter
        # A training step that opens the autocast around its own forward and runs its backward
        # (a whole-step CUDA graph must hold the autocast's exit: TE's amax reduction there)
        self.step_owns_autocast = False
        self.fp8_layers = fp8_layers  # None: the recipe's (resolved in layers, after auto chose)
        self.tokens_per_micro_batch: Optional[int] = None  # set by GPTLightningModule (fp8_layers)
        self.fp8_available = False
        self.fp8_active = False
        self.reason = "not set up yet"
        self.history: list[dict[str, Any]] = []
        self.bf16_modules: dict[str, str] = {}
        self._device_type = "cpu"
        self._amax_group: Any = None
        self._model_ref: Optional[weakref.ref] = None
        self._hooks: list[Any] = []
        self._converted = False  # the engine has converted the model (FP8 can be switched on)
        self._verify_pending = False
        self._loaded_state: Optional[dict[str, Any]] = None  # loaded before set-up: applied there
        self._planned: Optional[tuple[nn.Module, dict[str, str]]] = None  # see _plan_bf16
        self._converted_early: Optional[weakref.ref] = None  # see convert_before_sharding
        self.scaling_restored = 0  # TE modules whose delayed-scaling state came from a checkpoint

    # ----------------------------------------------------------------------------- status
    @property
    def effective_precision(self) -> str:
        """What really runs: ``fp8-<recipe>``, ``bf16`` or (a CPU without BF16) ``fp32``."""
        if self.fp8_active:
            return f"fp8-{self.recipe_config['recipe']}"
        return "fp32" if self.precision == "32-true" else "bf16"

    @property
    def status(self) -> str:
        """What runs and why: ``FP8 delayed`` or ``BF16 (fallback: <reason>)``."""
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
    def apply_auto_choice(self, recipe: Optional[str], figures: str) -> None:
        """``engine: auto``'s result (:func:`fp8_lightning.engine_auto.choose_engine`): an FP8
        recipe, keeping this plugin's fields that recipe has, or ``None`` for BF16."""
        self.auto, self.auto_figures = False, figures
        if recipe is None:
            self.auto_bf16 = f"engine auto measured BF16 fastest ({figures})"
            return
        fields = {k: v for k, v in self.recipe_config.items()
                  if k != "recipe" and k in RECIPES[recipe].defaults}
        self.recipe_config = build_recipe_config(recipe, **fields)
        self.engine = get_engine(RECIPES[recipe].engine)

    @property
    def backend(self) -> str:
        """The model backend the engine (or ``engine: auto``'s BF16 choice) needs."""
        return "torch" if self.auto_bf16 else self.engine.backend

    def _check_layers(self, gpt: nn.Module) -> None:
        n_layer = find_blocks(gpt)[1]
        too_many = [f"{key}={value} is more than the model's {n_layer} blocks"
                    for key, value in (("bf16_first_layers", self.bf16_first_layers),
                                       ("bf16_last_layers", self.bf16_last_layers))
                    if value > n_layer]
        if too_many:
            raise ConfigError(too_many + [f"valid: 0 to {n_layer}"], "FP8Precision")

    def _fp8_can_run(self, gpt: nn.Module) -> tuple[bool, str]:
        """Can the engine run FP8 on ``gpt`` here: (yes/no, the device, or why not)."""
        ok, reason = self.engine.available(self.recipe_config["recipe"])
        if self.auto_bf16:
            return False, self.auto_bf16
        if ok and (why := self.engine.cannot_convert(gpt)):
            return False, why
        if ok and not self.engine.gemm_modules(gpt):
            backend = self.engine.backend
            return False, (f"the model has no layers engine {self.engine.name!r} converts (they "
                           f"are those of model.backend: {backend}); use model.backend: "
                           f"{backend}" + " or auto" * (backend == "te"))
        return ok, reason

    def _plan_bf16(self, gpt: nn.Module) -> dict[str, str]:
        """The GEMMs kept BF16: the layer policy, then ``fp8_layers: auto``'s answer (once per
        model: a plan made before FSDP2 sharded it is the one :meth:`convert_module` uses)."""
        planned, self._planned = self._planned, None
        if planned is not None and planned[0] is gpt:
            return planned[1]
        bf16 = bf16_module_names(gpt, self.engine.gemm_modules(gpt), fp8_lm_head=self.fp8_lm_head,
                                 bf16_first_layers=self.bf16_first_layers,
                                 bf16_last_layers=self.bf16_last_layers)
        if self.layers == "auto":
            bf16.update(self._auto_layers(gpt))
        return bf16

    @property
    def layers(self) -> str:
        """``fp8_layers`` as this run applies it: the user's, else the recipe's default."""
        return self.fp8_layers or RECIPES[self.recipe_config["recipe"]].fp8_layers

    @property
    def gathers_float8(self) -> bool:
        """Can FSDP2 gather this run's FP8 weights as float8 (the engine and recipe have it)?"""
        return self.engine.gathers_float8(self.recipe_config["recipe"]) is None

    def float8_all_gather(self, gpt: nn.Module) -> list[tuple[nn.Module, str]]:
        """Before FSDP2 shards ``gpt`` (``FSDP2Strategy(float8_all_gather=True)``): the engine
        makes the weights of the GEMMs that will run FP8 gather as FP8. Returns them as
        ``(module, weight name)``, or none with the reason logged (then weights gather in BF16,
        as without the option)."""
        self._check_layers(gpt)
        ok, reason = self._fp8_can_run(gpt)
        pairs: list[tuple[nn.Module, str]] = []
        if ok:
            bf16 = self._plan_bf16(gpt)
            self._planned = (gpt, bf16)
            pairs, reason = self.engine.float8_all_gather(gpt, self.recipe_config, bf16)
        rank_zero_only(log.info)("FSDP2 float8 all-gather: %s", reason if pairs else
                                 f"off ({reason}); weights gather in BF16")
        return pairs

    def convert_before_sharding(self, module: nn.Module) -> None:
        """FSDP2Strategy, on a model of your own whose modules the engine replaces
        (``Engine.swaps_modules``: TE's ``te.Linear`` for ``nn.Linear``): the conversion before
        ``fully_shard``, which gathers each parameter into the module that held it then. The
        strategy's own :meth:`convert_module` call after sharding leaves the module as it is."""
        self.convert_module(module)
        self._converted_early = weakref.ref(module)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        early, self._converted_early = self._converted_early, None
        if early is not None and early() is module:
            return module  # converted before FSDP2 sharded it
        gpt = find_gpt(module)
        self._check_layers(gpt)
        self._model_ref = weakref.ref(gpt)
        # Decided once here, not on every step: the strategy has set up devices and process
        # groups before it converts the module.
        self._device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self._amax_group = _data_parallel_group()
        if self.auto:  # not set up through GPTLightningModule: no probe, the recipe's engine
            self.auto, self.auto_figures = False, "not measured (no GPTLightningModule set-up)"
        ok, reason = self._fp8_can_run(gpt)
        self.fp8_available = ok
        if not ok:
            if self.on_unavailable == "error" and not self.auto_bf16:
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
            if self.converter is not None:
                self.converter.convert(gpt, engine=self.engine.name, fp8=False,
                                       weights=self.weights, swapped=[])
            self._apply_loaded_state()
            return module
        self._remove_hooks()  # set up again (fit, then validate): never stack hooks twice
        self.bf16_modules = self._plan_bf16(gpt)
        note = self.engine.speed_note(gpt, self.bf16_modules)  # before any layer is swapped
        options = ({} if self.converter is None else
                   self.converter.engine_options(gpt, self.engine.name))
        self._hooks = self.engine.convert(gpt, self.recipe_config, self.bf16_modules, **options)
        self._converted = True
        if self.converter is not None:
            self.converter.convert(gpt, engine=self.engine.name, fp8=True, weights=self.weights,
                                   swapped=list(getattr(self.engine, "swapped", [])))
        elif note:
            note += ("; FP8Precision(converter=fp8_lightning.Speedups()) replays its blocks as CUDA "
                     "graphs of their compiled forward, fuses its MLPs and sums its weight "
                     "gradients in FP32")
        self.fp8_active, self.reason = True, reason
        self._verify_pending = True
        self._record("enabled", f"{reason}; recipe {self.recipe_config}")
        log.info("FP8 %s on %s; BF16 modules: %s", describe(self.recipe_config), reason,
                 ", ".join(f"{k} ({v})" for k, v in self.bf16_modules.items()) or "none")
        if note:
            _warn(note)
        self._apply_loaded_state()
        return module

    def _auto_layers(self, gpt: nn.Module) -> dict[str, str]:
        """``fp8_layers: auto``: the GEMMs the engine finds would not gain from FP8 here."""
        kept, how = self.engine.auto_bf16(self.engine.gemm_modules(gpt), self.bf16_modules,
                                          self.recipe_config, self.tokens_per_micro_batch)
        rank_zero_only(log.info)("fp8_layers=auto %s: %s", how, "; ".join(
            f"{k}: {v}" for k, v in kept.items()) or "no GEMM kept BF16")
        return kept

    # ----------------------------------------------------------------------------- contexts
    @contextmanager
    def _context(self, fp8: bool) -> Generator[None, None, None]:
        with ExitStack() as stack:
            if self.precision == "bf16-mixed":
                stack.enter_context(torch.autocast(self._device_type, dtype=torch.bfloat16))
            if self._converted:
                stack.enter_context(self.engine.context(fp8 and self.fp8_active,
                                                        self._amax_group))
            if self.converter is not None:
                stack.enter_context(self.converter.context())
            yield

    @contextmanager
    def _training_context(self, step_start: bool = True) -> Generator[None, None, None]:
        """A training forward in FP8 (``step_start``: the Trainer's training step, not one of
        Fabric's forwards); after the first FP8 step, checks that FP8 really ran."""
        with ExitStack() as stack:
            if not self.step_owns_autocast:
                stack.enter_context(self._context(fp8=True))
            if self.converter is not None:
                stack.enter_context(self.converter.training_forward(step_start))
            yield
        if self._verify_pending and self.fp8_active:
            self._verify_fp8_ran()

    def _verify_fp8_ran(self) -> None:
        """After the first FP8 step: did any TE module really run FP8? If not, say so."""
        self._verify_pending = False
        ran = self.engine.modules_ran(self.model)
        if not ran:
            gemms = self.engine.gemm_modules(self.model) if self.model is not None else {}
            policy = (f" (the layer policy keeps every GEMM BF16, fp8_layers={self.layers}; "
                      "fp8_layers: all runs them in FP8)"
                      if gemms and all(runs_bf16(n, self.bf16_modules) for n in gemms) else "")
            self.disable_fp8(f"no {self.engine.name} GEMM module ran FP8 in the first step"
                             + policy)
        else:
            log.info("FP8 verified: %d %s modules ran FP8 in the first step", len(ran),
                     self.engine.name)

    # ----------------------------------------------------------------------------- switch
    def disable_fp8(self, reason: str, step: Optional[int] = None) -> None:
        """Run BF16 from now on (until :meth:`enable_fp8`)."""
        if not self.fp8_active:
            return
        self.fp8_active, self.reason = False, reason
        if self.model is not None and self._converted:
            self.engine.set_enabled(self.model, False)
        self._record("disabled", reason, step)
        _warn(f"FP8 disabled{'' if step is None else f' at step {step}'}: {reason}. "
              "Training continues in BF16.")

    def enable_fp8(self, reset_scaling: bool = True, step: Optional[int] = None) -> bool:
        """Return to FP8 (with fresh scaling state by default); False if FP8 cannot run here."""
        if self.fp8_active:
            return True
        if not self.fp8_available:
            return False
        if self.model is not None and self._converted:
            if reset_scaling:
                self.engine.reset_scaling(self.model)
            self.engine.set_enabled(self.model, True)
        self.fp8_active, self.reason = True, "re-enabled"
        self._verify_pending = True
        self._record("enabled", f"re-enabled (reset_scaling={reset_scaling})", step)
        log.info("FP8 re-enabled%s", "" if step is None else f" at step {step}")
        return True

    # ----------------------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        state = {"recipe": dict(self.recipe_config), "engine": self.engine.name,
                 "auto": self.auto_figures, "weights": self.weights,
                 "fp8_active": self.fp8_active, "effective_precision": self.effective_precision,
                 "reason": self.reason, "history": [dict(h) for h in self.history],
                 "bf16_modules": dict(self.bf16_modules)}
        if self.model is not None and self.fp8_available and \
                RECIPES[self.recipe_config["recipe"]].stateful:
            state["scaling"] = self.engine.export_scaling(self.model)
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
            if saved.get("recipe") == self.recipe_config["recipe"] and \
                    RECIPES[saved["recipe"]].stateful:
                self.scaling_restored = self.engine.import_scaling(self.model, scaling)
            else:
                log.info("FP8 scaling state in the checkpoint (%s) not used by recipe %s",
                         saved.get("recipe"), self.recipe_config["recipe"])

    @override
    def teardown(self) -> None:
        if self.converter is not None:
            self.converter.teardown()
        super().teardown()

    @override
    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        if self.converter is None:
            return super().backward(tensor, model, *args, **kwargs)
        with self.converter.context():
            super().backward(tensor, model, *args, **kwargs)

    @override
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        if self.converter is not None:
            self.converter.before_backward()
        return super().pre_backward(tensor, module)

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
        # The world under DDP, FSDP2 and HSDP alike, never an HSDP shard group: each rank sees its
        # own data, and replicas quantising with different scales would drift apart.
        return torch.distributed.group.WORLD
    return None
