"""``FP8Stats``: opt-in FP8 scaling statistics every K steps, logged to TensorBoard.

Two real sources, both read on the K-th step only:

1. **amax and scale** (delayed scaling, the only recipe with an amax history): for every TE GEMM
   module that runs FP8, ``module.fp8_meta["scaling_fwd"]`` / ``["scaling_bwd"]`` hold
   ``amax_history`` (``[amax_history_len, 3 * num_gemms]`` forward, ``[.., 2 * num_gemms]``
   backward) and ``scale``. Per GEMM, forward slot ``3g`` is the input, ``3g + 1`` the weight;
   backward slot ``2g`` is the output gradient (TE's ``FP8FwdTensors`` / ``FP8BwdTensors``).
   Logged: ``fp8_amax/<gemm>.<tensor>`` = the maximum over the history window (what the scale
   is computed from with ``amax_compute_algo=max``) and ``fp8_scale/<gemm>.<tensor>``. All values
   go to the host in one copy.
2. **underflow / overflow percentages** through TransformerEngine's debug API
   (``nvdlfw_inspect`` + TE's ``LogFp8TensorStats`` feature): the percentage of non-zero
   elements that quantize to zero (``underflows%``) and, for delayed scaling, of elements
   clipped to the FP8 maximum (``overflows%``), computed by TE from the real high-precision
   tensor and its real FP8 quantization, per layer, for activations, gradients and weights.
   Logged as ``fp8_underflows_pct/<layer>.<tensor>`` (and ``.../all_layers_max.<tensor>``).
   The callback writes the nvdlfw_inspect config to ``<log_dir>/fp8_stats/fp8_stats.yaml``,
   initialises the debug API in ``setup`` (before the model's TE modules exist, as TE
   requires) with a statistics logger of its own, names the TE modules after their place in the
   model, and switches TE's debug path on for the K-th steps only (setting the debug iteration
   to the step number, then ``debug_api.step()`` after it to gather the values): the other
   steps, validation and text sampling run TE's normal path. GPU + TransformerEngine +
   ``pip install nvdlfw-inspect`` only; without them a log line says what is off and why.

<gemm> is the module's name in the model (``blocks.3.qkv``; ``blocks.3.mlp.fc1`` / ``.fc2`` for
the two GEMMs of ``LayerNormMLP``); modules that the layer policy keeps BF16 are left out.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import nn
from typing_extensions import override

from ..config import ConfigError
from ..logs import log_metrics
from .plugin import fp8_plugin
from .policy import find_gpt, runs_bf16
from .te_engine import recipe_available, te_gemm_modules

log = logging.getLogger(__name__)

AMAX = "fp8_amax"
SCALE = "fp8_scale"
STAT_PREFIX = "fp8_"  # + underflows_pct, overflows_pct, ...
SUMMARY = "all_layers_max"
CONFIG_NAME = "fp8_stats.yaml"
TENSORS = ("activation", "gradient", "weight")
# Forward slots per GEMM g: 3g + slot; backward: 2g + slot (TE FP8FwdTensors / FP8BwdTensors).
FWD_SLOTS = {0: "input", 1: "weight"}
BWD_SLOTS = {0: "grad_output"}
BF16_SUFFIX = "[bf16]"  # TE module names of layers the policy keeps BF16 (not matched)
_STAT_NAME = re.compile(r"^(?P<layer>.+)_(?P<tensor>activation|gradient|weight)_(?P<stat>.+)$")


def _fp8_active(trainer: "L.Trainer") -> bool:
    plugin = fp8_plugin(trainer)
    return plugin is not None and plugin.fp8_active


def default_stats(recipe: str) -> list[str]:
    """LogFp8TensorStats statistics the recipe supports (overflows only exist for delayed)."""
    return ["underflows%", "overflows%"] if recipe == "delayed" else ["underflows%"]


def debug_config(every_n_steps: int, tensors: list[str], stats: list[str],
                 layers: str = "") -> dict[str, Any]:
    """The nvdlfw_inspect config: LogFp8TensorStats every K steps on the FP8 layers.

    Only plain module names match (``[\\w.]+``): the callback names layers the policy keeps BF16
    ``<name>[bf16]`` so that they are skipped. ``layers`` further restricts by regex search.
    """
    pattern = r"^(?=[\w.]+$)" + (f".*?(?:{layers})" if layers else "")
    return {"fp8_lightning_fp8_stats": {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": pattern},
        "transformer_engine": {"LogFp8TensorStats": {
            "enabled": True, "tensors": list(tensors), "stats": list(stats),
            "freq": int(every_n_steps)}},
    }}


def _slug(stat: str) -> str:
    return stat.replace("%", "_pct")


def to_floats(values: dict[str, Any]) -> dict[str, float]:
    """Floats from a mix of floats and 0-dim tensors, with one device -> host copy."""
    tensors = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in values.items() if k not in set(tensors)}
    if tensors:
        flat = torch.stack([values[k].detach().float().reshape(()) for k in tensors]).tolist()
        out.update(zip(tensors, flat))
    return out


def tensor_stat_metrics(values: dict[str, Any]) -> dict[str, float]:
    """``{"blocks.0.qkv_activation_underflows%": v}`` (TE's names) -> TensorBoard tags."""
    values = to_floats(values)
    out: dict[str, float] = {}
    summary: dict[str, float] = {}
    for name, value in values.items():
        match = _STAT_NAME.match(name)
        if match is None:
            out[f"{STAT_PREFIX}debug/{name}"] = value
            continue
        stat, tensor = _slug(match["stat"]), match["tensor"]
        out[f"{STAT_PREFIX}{stat}/{match['layer']}.{tensor}"] = value
        key = f"{STAT_PREFIX}{stat}/{SUMMARY}.{tensor}"
        summary[key] = max(summary.get(key, float("-inf")), value)
    out.update(summary)
    return out


def gemm_names(name: str, module: nn.Module, num_gemms: int) -> list[str]:
    """One name per GEMM of a TE module (``LayerNormMLP``: ``.fc1``/``.fc2``, as TE's debug API)."""
    if num_gemms == 1:
        return [name]
    if num_gemms == 2 and hasattr(module, "fc1_weight"):
        return [f"{name}.fc1", f"{name}.fc2"]
    return [f"{name}.gemm{g + 1}" for g in range(num_gemms)]


def scaling_stats(modules: dict[str, nn.Module]) -> dict[str, float]:
    """amax (max over the history window) and scale per GEMM tensor of delayed-scaling modules."""
    keys: list[str] = []
    values: list[torch.Tensor] = []
    for name, module in modules.items():
        meta = getattr(module, "fp8_meta", None) or {}
        num = meta.get("num_gemms")
        fwd, bwd = meta.get("scaling_fwd"), meta.get("scaling_bwd")
        if not num or not hasattr(fwd, "amax_history") or not hasattr(bwd, "amax_history"):
            continue
        fwd_amax = fwd.amax_history.amax(dim=0)
        bwd_amax = bwd.amax_history.amax(dim=0)
        for g, gemm in enumerate(gemm_names(name, module, num)):
            for meta_amax, meta_scale, width, slots in ((fwd_amax, fwd.scale, 3, FWD_SLOTS),
                                                        (bwd_amax, bwd.scale, 2, BWD_SLOTS)):
                for slot, label in slots.items():
                    i = width * g + slot
                    keys += [f"{AMAX}/{gemm}.{label}", f"{SCALE}/{gemm}.{label}"]
                    values += [meta_amax[i], meta_scale[i]]
    if not values:
        return {}
    flat = torch.stack([v.float() for v in values]).tolist()  # one device -> host copy
    return dict(zip(keys, flat))


def _make_collector() -> Any:
    """An nvdlfw_inspect statistics logger that keeps the values for the callback."""
    from nvdlfw_inspect.logging import BaseLogger

    class Collector(BaseLogger):
        def __init__(self) -> None:
            super().__init__()
            self.values: dict[str, Any] = {}

        def log_scalar(self, name: str, value: Any, iteration: int, **kwargs: Any) -> None:
            self.values[name] = value  # a 0-dim device tensor: read in one copy with the rest

    return Collector()


class FP8Stats(Callback):
    """Opt-in FP8 scaling statistics every ``every_n_steps`` steps (see the module doc).

    Args:
        every_n_steps: K: the statistics are gathered on every K-th optimizer step only.
        scaling: log per-GEMM amax and scale (delayed scaling).
        tensor_stats: log underflow/overflow percentages through nvdlfw_inspect + TE's
            ``LogFp8TensorStats`` (GPU, TE and ``nvdlfw-inspect`` needed).
        tensors: which tensors: ``activation``, ``gradient``, ``weight``.
        stats: LogFp8TensorStats statistics (default: ``underflows%`` and, for delayed scaling,
            ``overflows%``; also ``scale_inv_min``, ``scale_inv_max``, ``mse``).
        layers: a regex; only layers whose name it matches (search) get tensor statistics.
        log_dir: where the nvdlfw_inspect config and logs go (default ``<run log dir>/fp8_stats``).
    """

    def __init__(self, every_n_steps: int = 100, scaling: bool = True, tensor_stats: bool = True,
                 tensors: Optional[list[str]] = None, stats: Optional[list[str]] = None,
                 layers: str = "", log_dir: Optional[str] = None) -> None:
        super().__init__()
        problems = []
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            problems.append(f"every_n_steps={every_n_steps!r} must be an integer >= 1")
        bad = [t for t in (tensors or []) if t not in TENSORS]
        if bad:
            problems.append(f"tensors={bad}; valid: {', '.join(TENSORS)}")
        if layers:
            try:
                re.compile(layers)
            except re.error as err:
                problems.append(f"layers={layers!r} is not a valid regex ({err})")
        if problems:
            raise ConfigError(problems, "FP8Stats")
        self.every_n_steps = every_n_steps
        self.scaling, self.tensor_stats = scaling, tensor_stats
        self.tensors = list(tensors or TENSORS)
        self.stats = list(stats) if stats else None
        self.layers, self.log_dir = layers, log_dir
        self.enabled = False
        self.recipe: Optional[str] = None
        self.debug_active = False  # nvdlfw_inspect initialised by this callback
        self.config_path: Optional[Path] = None
        self.logged_steps: list[int] = []
        self._modules: dict[str, nn.Module] = {}
        self._collector: Any = None
        self._debug_on = False
        self._last_step = -1

    # ------------------------------------------------------------------------- setup
    @override
    def setup(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        self.enabled = False
        warn = rank_zero_only(log.warning)
        plugin = fp8_plugin(trainer)
        if plugin is None:
            warn("FP8 stats off: the Trainer's precision plugin is not fp8_lightning.FP8Precision")
            return
        recipe = plugin.recipe_config["recipe"]
        if plugin.engine.name != "te":
            warn(f"FP8 stats off: they read TransformerEngine's FP8 state; engine "
                 f"{plugin.engine.name!r} (recipe {recipe!r}) has none")
            return
        ok, reason = recipe_available(recipe)
        if not ok:
            warn(f"FP8 stats off: FP8 cannot run here ({reason})")
            return
        backend = getattr(pl_module, "backend_name", "te")
        if backend != "te":
            warn(f"FP8 stats off: the model runs on the {backend} backend (no TE modules)")
            return
        self.enabled, self.recipe = True, recipe
        parts = []
        if self.scaling:
            parts.append("amax/scale" if recipe == "delayed" else
                         f"no amax/scale (recipe {recipe!r} keeps no amax history)")
        if self.tensor_stats:
            parts.append(self._start_debug(trainer, recipe))
        rank_zero_only(log.info)(f"FP8 stats every {self.every_n_steps} steps: {'; '.join(parts)}")

    def _start_debug(self, trainer: "L.Trainer", recipe: str) -> str:
        try:
            import nvdlfw_inspect.api as debug_api
        except ImportError:
            return ("underflow/overflow statistics off: nvdlfw_inspect is not installed "
                    "(pip install nvdlfw-inspect)")
        try:
            import transformer_engine.debug as te_debug
            from transformer_engine.debug.pytorch.debug_state import TEDebugState
        except ImportError as err:
            return f"underflow/overflow statistics off: TE's debug API is missing ({err})"
        import yaml

        stats = self.stats or default_stats(recipe)
        root = self.log_dir or os.path.join(trainer.log_dir or trainer.default_root_dir, "fp8_stats")
        Path(root).mkdir(parents=True, exist_ok=True)
        self.config_path = Path(root) / CONFIG_NAME
        if trainer.is_global_zero:
            self.config_path.write_text(yaml.safe_dump(
                debug_config(self.every_n_steps, self.tensors, stats, self.layers), sort_keys=False))
        trainer.strategy.barrier("fp8_stats_config")
        if debug_api.DEBUG_MANAGER is not None:  # left on by an earlier run in this process
            debug_api.end_debug()
        TEDebugState._reset()  # TE refuses debug if it saw a TE module built without it
        self._collector = _make_collector()
        debug_api.initialize(config_file=str(self.config_path),
                             feature_dirs=[os.path.join(os.path.dirname(te_debug.__file__), "features")],
                             statistics_logger=self._collector, log_dir=root)
        TEDebugState.initialize()  # modules built earlier see the debug state as well
        # On until the model is built (TE refuses to build a module while the debug API is
        # initialised but its debug state is off); from on_fit_start, on for the K-th steps only.
        self.debug_active, self._debug_on = True, True
        return (f"{', '.join(stats)} of {', '.join(self.tensors)} through nvdlfw_inspect "
                f"(LogFp8TensorStats; config {self.config_path})")

    @override
    def on_fit_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        if not self.enabled:
            return
        bf16 = fp8_plugin(trainer).bf16_modules
        self._modules = {}
        for name, module in te_gemm_modules(find_gpt(pl_module)).items():
            keep_bf16 = runs_bf16(name, bf16)
            module.name = name + BF16_SUFFIX if keep_bf16 else name  # TE's debug layer name
            if not keep_bf16:
                self._modules[name] = module
        self._set_debug(False)

    @override
    def on_train_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self._last_step = trainer.global_step
        self._set_debug(False)

    # ------------------------------------------------------------------------- per step
    def _set_debug(self, on: bool) -> None:
        """TE's debug path runs on the K-th steps only: off, a layer costs TE nothing extra."""
        if not self.debug_active or on == self._debug_on:
            return
        from transformer_engine.debug.pytorch.debug_state import TEDebugState

        TEDebugState.debug_enabled = on
        self._debug_on = on

    def _stats_step(self, trainer: "L.Trainer") -> bool:
        """Does the optimizer step now running complete a multiple of K (with FP8 on)?"""
        return ((trainer.global_step + 1) % self.every_n_steps == 0
                and _fp8_active(trainer))

    @override
    def on_train_batch_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule",
                             batch: Any, batch_idx: int) -> None:
        if not self.debug_active:
            return
        on = self._stats_step(trainer)
        if on and not self._debug_on:
            import nvdlfw_inspect.api as debug_api

            # The debug iteration of a step is the global step it completes (a multiple of K,
            # where the config's freq: K enables LogFp8TensorStats).
            debug_api.initialize_training_step(trainer.global_step + 1)
        self._set_debug(on)

    @override
    def on_validation_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self._set_debug(False)  # validation and text samples run BF16: nothing to inspect

    @override
    def on_train_batch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule",
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.enabled:
            return
        step = trainer.global_step
        if step == self._last_step:  # accumulating: no optimizer step yet
            return
        self._last_step = step
        metrics: dict[str, float] = {}
        if self._debug_on:
            import nvdlfw_inspect.api as debug_api

            debug_api.step()  # gathers (and reduces) the statistics of the debug iteration
            self._set_debug(False)
            if self._collector.values:
                metrics.update(tensor_stat_metrics(self._collector.values))
                self._collector.values.clear()
        if (self.scaling and self.recipe == "delayed" and step % self.every_n_steps == 0
                and _fp8_active(trainer)):
            metrics.update(scaling_stats(self._modules))
        if metrics:
            self.logged_steps.append(step)
            log_metrics(trainer, metrics)

    @override
    def teardown(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        if stage == "fit":
            self._end_debug()

    @override
    def on_exception(self, trainer: "L.Trainer", pl_module: "L.LightningModule",
                     exception: BaseException) -> None:
        # A failed fit skips teardown; left on, the debug API would keep the next fit in this
        # process (a notebook's) off its CUDA graphs and on TE's debug path.
        self._end_debug()

    def _end_debug(self) -> None:
        if self.debug_active:
            import nvdlfw_inspect.api as debug_api

            debug_api.end_debug()  # also resets TE's debug state
            self.debug_active = self._debug_on = False
