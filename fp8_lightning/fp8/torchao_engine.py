"""The PyTorch-native engine: torchao's float8 training GEMMs in the plain PyTorch layers (backend
``torch``), compiled with the model (``model.compile``), as torchtitan runs it.

Recipes ``tensorwise`` (one scale per tensor, cuBLAS; the fastest), ``rowwise`` (a scale per
row, CUTLASS; power-of-two scales) and ``rowwise_with_gw_hp`` (rowwise, the weight gradient in
high precision): all dynamic, so there is no scaling state to carry.

Why not ``torchao.float8.convert_to_float8_training``: it swaps ``nn.Linear`` modules for its
``Float8Linear``, and this package's PyTorch layers are TE-shaped fused modules
(``LayerNormLinear``, ``LayerNormMLP`` with ``fc1_weight``/``fc2_weight``) that keep TE's
parameter names so checkpoints move between backends. The engine calls the same autograd
function ``Float8Linear.forward`` calls (``matmul_with_hp_or_float8_args``), with the recipe's
``Float8LinearConfig``, from each converted layer's matmuls; a fused layer may run one of its
GEMMs in float8 and the other in BF16 (``fp8_layers: auto``).

Under FSDP2 (``FSDP2Strategy(float8_all_gather=True)``, tensorwise) the float8 GEMMs' weights
gather as float8 (:meth:`TorchaoEngine.float8_all_gather`): torchao's
``WeightWithDynamicFloat8CastTensor``, what ``enable_fsdp_float8_all_gather`` gives a
``Float8Linear``, with the scales of all of them from one all-reduce per step
(:func:`precompute_float8_scales`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, FrozenSet, Optional

import torch
import torch.nn.functional as F
from lightning_utilities.core.imports import RequirementCache
from torch import nn

from ..te_availability import gpu_fp8_capable
from .engine import Engine
from .policy import gemm_weights, is_conv1d, runs_bf16

TORCHAO_MIN_VERSION = "0.12"  # Float8LinearConfig.from_recipe_name with the three recipes
TORCHAO_REQUIREMENT = RequirementCache(f"torchao>={TORCHAO_MIN_VERSION}")
# Row-wise scaled GEMMs (torch._scaled_mm with per-row scales) need Hopper; tensorwise runs on Ada.
MIN_CAPABILITY = {"tensorwise": (8, 9), "rowwise": (9, 0), "rowwise_with_gw_hp": (9, 0)}


def float8_linear(recipe: str, bf16_shapes: FrozenSet[tuple[int, int]] = frozenset()
                  ) -> Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]:
    """``F.linear(x, weight, bias)`` with the GEMMs (forward and both backward) in float8 by
    torchao's ``recipe``; what ``torchao.float8.Float8Linear.forward`` does. A weight whose
    (out, in) shape is in ``bf16_shapes`` keeps ``F.linear`` (a static shape: under
    ``torch.compile`` the test is decided while tracing)."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    config, mm_config = _configs(recipe)

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if tuple(weight.shape) in bf16_shapes:
            return F.linear(x, weight, bias)
        device = x.device.type
        if torch.is_autocast_enabled(device):  # the dtype autocast would give F.linear's input
            x = x.to(torch.get_autocast_dtype(device))
        out = matmul_with_hp_or_float8_args.apply(x, weight.t(), mm_config, config)
        return out if bias is None else out + bias.to(out.dtype)

    linear.recipe = recipe  # type: ignore[attr-defined]
    return linear


@functools.lru_cache(maxsize=None)
def _configs(recipe: str) -> tuple[Any, Any]:
    """The recipe's ``Float8LinearConfig`` and the ``LinearMMConfig`` its GEMMs use, built once
    (as ``Float8Linear.__init__`` builds them)."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    mm = [ScaledMMConfig(config.emulate, gemm.use_fast_accum, False, config.pad_inner_dim)
          for gemm in (config.gemm_config_output, config.gemm_config_grad_input,
                       config.gemm_config_grad_weight)]
    return config, LinearMMConfig(*mm)


def size_filter(recipe: str) -> Optional[Callable[[tuple[int, int]], bool]]:
    """torchao's own "does float8 pay for this GEMM" heuristic for ``recipe`` (dims multiples of
    16 and above its per-recipe size thresholds, from torchao's own benchmarks), as a test of one
    ``(out, in)`` weight shape; ``None`` where torchao has none (``rowwise_with_gw_hp``).

    torchao offers it only as a filter of ``nn.Linear`` modules (the experimental
    ``_auto_filter_for_recipe``, which torchtitan's ``float8.filter_fqns: [auto_filter_small_kn]``
    calls); our fused layers hold two GEMMs each, so it is asked about a meta-device
    ``nn.Linear`` of each weight's shape rather than copying its thresholds here.
    """
    try:  # private and experimental in torchao 0.18: a torchao without it keeps every GEMM
        from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

        pays = _auto_filter_for_recipe(recipe, filter_fqns=[])
    except (ImportError, NotImplementedError):
        return None
    return lambda shape: pays(nn.Linear(shape[1], shape[0], bias=False, device="meta"), "")


def _plain_weights(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                   local_metadata: Any) -> None:
    """A state-dict hook: each float8-gathered weight as its plain tensor (a ``DTensor`` of it
    under FSDP2), so that checkpoints hold no torchao subclass and load into either backend,
    into BF16 and without torchao."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    for key, value in state_dict.items():
        local = getattr(value, "_local_tensor", value)
        if key.startswith(prefix) and isinstance(local, WeightWithDynamicFloat8CastTensor):
            plain = local._tensor.detach()
            if local is value:
                state_dict[key] = plain
            else:
                from torch.distributed.tensor import DTensor

                state_dict[key] = DTensor.from_local(plain, value.device_mesh,
                                                     value.placements, shape=value.shape,
                                                     stride=value.stride())


@torch.no_grad()
def precompute_float8_scales(weights: list[torch.Tensor]) -> None:
    """Every float8-gathered weight's tensorwise scale from its current values, in one fused
    amax and one all-reduce, for FSDP2's next all-gathers (without it each weight's gather
    all-reduces its own amax). torchao's ``precompute_float8_dynamic_scale_for_fsdp`` does this
    for its ``Float8Linear`` modules only, which this package's fused layers are not; the
    arithmetic is the same."""
    from torchao.float8.float8_utils import EPS

    if not weights:
        return
    locals_ = [getattr(w, "_local_tensor", w) for w in weights]
    amax = torch.stack(torch._foreach_norm(weights, ord=math.inf))  # (n,) DTensor: Partial
    # the all-reduce: Replicate, over the shard group (HSDP: each replica group's; the replicas
    # hold the same weights, so every rank of the world gets the same scales)
    amax = torch.clamp(amax, EPS).to(torch.float64)
    scale = torch.finfo(locals_[0]._dtype).max / amax
    scale = getattr(scale, "to_local", lambda: scale)().to(torch.float32)
    for i, local in enumerate(locals_):
        local._precomputed_scale = scale[i]


def forget_float8_scales(weights: list[torch.Tensor]) -> None:
    """After the weights change (an optimizer step): gathers compute their own scales until the
    next :func:`precompute_float8_scales`, never a stale one."""
    for w in weights:
        getattr(w, "_local_tensor", w)._precomputed_scale = None


def route_linear(module: nn.Module) -> None:
    """Give a user's ``nn.Linear`` (or Hugging Face's ``Conv1D``) the switch this package's layers
    have (``float8``: the engine's GEMM, or None for the module's own forward). The module, its
    parameters and its state dict stay as they are, so its checkpoints load with or without FP8;
    swapping it for torchao's ``Float8Linear`` would not let the BF16 fallback switch back in
    place (and ``Conv1D`` is no ``nn.Linear``)."""
    module.float8 = None
    # a partial, not a closure: a deep copy of the module (EMA, SWA) then calls its own weights
    module.forward = functools.partial(_routed_forward, module)


def _routed_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gemm = module.float8
    if gemm is None:
        return type(module).forward(module, x)
    weight = module.weight.t() if is_conv1d(module) else module.weight  # (out, in)
    return gemm(x, weight, module.bias)


def dequantizing_linear(x: torch.Tensor, weight: torch.Tensor,
                        bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear`` for the BF16 fallback of a float8-gathered weight: FSDP2 hands the GEMM a
    ``Float8TrainingTensor``, taken back to its high precision (the weight keeps float8's
    rounding while FP8 is off; activations and gradients are BF16)."""
    if hasattr(weight, "to_original_precision"):
        weight = weight.to_original_precision()
    return F.linear(x, weight, bias)


class TorchaoEngine(Engine):
    """Float8 GEMMs in the PyTorch layers; the switch to BF16 puts ``F.linear`` back."""

    name, backend = "torchao", "torch"

    def __init__(self) -> None:
        self.converted: dict[str, nn.Module] = {}
        self.gemms: dict[str, Callable[..., torch.Tensor]] = {}  # each converted module's GEMM
        self.gathered: list[tuple[nn.Module, str]] = []  # weights FSDP2 gathers as float8

    def available(self, recipe: str) -> tuple[bool, str]:
        if not TORCHAO_REQUIREMENT:
            return False, ("torchao >= %s is not installed (pip install "
                           '"fp8-lightning[torchao]")' % TORCHAO_MIN_VERSION)
        ok, gpu = gpu_fp8_capable()
        if not ok:
            return False, gpu
        need = MIN_CAPABILITY[recipe]
        if torch.cuda.get_device_capability() < need:
            return False, (f"torchao recipe {recipe!r} needs compute capability >= "
                           f"{need[0]}.{need[1]}; {gpu} has less")
        return True, gpu

    def gemm_modules(self, model: nn.Module) -> dict[str, nn.Module]:
        """This package's PyTorch layers (their class declares the empty ``float8`` GEMM slot this
        engine fills; found by it, so that ``fp8/`` imports nothing of the model) and any other
        model's ``nn.Linear`` modules."""
        return {name: m for name, m in model.named_modules()
                if getattr(type(m), "float8", False) is None or isinstance(m, nn.Linear)
                or is_conv1d(m)}

    def auto_bf16(self, gemm_modules: dict[str, nn.Module], keep: dict[str, str],
                  config: dict[str, Any], tokens: Optional[int]) -> tuple[dict[str, str], str]:
        """torchao's size filter per GEMM (the micro-batch does not enter it): a module whose
        GEMMs all fail it stays BF16 whole, one whose GEMMs differ keeps the small one BF16
        (``<module>.<weight>``)."""
        recipe = config["recipe"]
        pays = size_filter(recipe)
        if pays is None:
            return {}, f"has no torchao size filter for {recipe}"
        kept: dict[str, str] = {}
        for name, module in gemm_modules.items():
            if runs_bf16(name, keep):
                continue
            weights = gemm_weights(module)
            small = {w: s for w, s in weights.items() if not pays(s)}
            why = {w: f"fp8_layers=auto: torchao's {recipe} size filter ({s[1]}->{s[0]})"
                   for w, s in small.items()}
            if len(small) == len(weights):
                kept[name] = "; ".join(why.values())
            else:
                kept.update({f"{name}.{w}": reason for w, reason in why.items()})
        return kept, f"by torchao's size filter for {recipe}"

    def gathers_float8(self, recipe: str) -> Optional[str]:
        if recipe != "tensorwise":  # torchao's float8 all-gather has the tensorwise scales only
            return f"torchao gathers float8 for recipe tensorwise only, not {recipe}"
        return None

    def float8_all_gather(self, model: nn.Module, config: dict[str, Any],
                          bf16_modules: dict[str, str]) -> tuple[list[tuple[nn.Module, str]], str]:
        """Wrap each float8 GEMM weight in torchao's ``WeightWithDynamicFloat8CastTensor``, as
        ``Float8Linear.from_float`` does with ``enable_fsdp_float8_all_gather``: ``fully_shard``
        (which must come after) then gathers its float8 data and scale, half the bytes of a BF16
        gather, and the GEMM receives a ``Float8TrainingTensor``. Tensorwise only in torchao."""
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        recipe = config["recipe"]
        why_not = self.gathers_float8(recipe)
        if why_not:
            return [], why_not
        f8_config, mm_config = _configs(recipe)
        dtype = f8_config.cast_config_weight.target_dtype
        pairs = []
        for name, module in self.gemm_modules(model).items():
            if runs_bf16(name, bf16_modules):
                continue
            for weight in gemm_weights(module):
                if f"{name}.{weight}" in bf16_modules:
                    continue
                param = getattr(module, weight)
                setattr(module, weight, nn.Parameter(
                    WeightWithDynamicFloat8CastTensor(param, mm_config, dtype),
                    requires_grad=param.requires_grad))
                pairs.append((module, weight))
        if pairs:
            model.register_state_dict_post_hook(_plain_weights)
        self.gathered = pairs
        return pairs, f"{len(pairs)} GEMM weights gather as float8 (torchao, tensorwise)"

    def convert(self, model: nn.Module, config: dict[str, Any],
                bf16_modules: dict[str, str], fuse_mlp: Optional[bool] = False) -> list[Any]:
        self.converted = {name: m for name, m in self.gemm_modules(model).items()
                          if not runs_bf16(name, bf16_modules)}
        for module in self.converted.values():
            if (isinstance(module, nn.Linear) or is_conv1d(module)) and not hasattr(module, "float8"):
                route_linear(module)
        self.gemms = {name: float8_linear(config["recipe"], frozenset(
            shape for weight, shape in gemm_weights(m).items() if f"{name}.{weight}" in bf16_modules))
            for name, m in self.converted.items()}
        self.set_enabled(model, True)
        return []

    def set_enabled(self, model: nn.Module, on: bool) -> None:
        # A changed attribute is a guard failure for torch.compile: the next step recompiles
        # once, for each state (FP8 / BF16), then both graphs are cached.
        off = dequantizing_linear if self.gathered else None
        for name, module in self.converted.items():
            module.float8 = self.gemms[name] if on else off

    def modules_ran(self, model: Optional[nn.Module]) -> list[str]:
        """The converted layers whose matmuls go through the float8 GEMM (every call of theirs
        does; under ``torch.compile`` a traced call leaves no Python trace to count)."""
        return [name for name, m in self.converted.items() if m.float8 is not None]
