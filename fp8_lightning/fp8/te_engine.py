"""The TransformerEngine engine: FP8 in TE's own modules (backend ``te``), under ``te.autocast``.

All TE-specific FP8 code of the package is here and in :mod:`.scaling_state`; the bench, the
doctor and the statistics callback ask this module instead of TE.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from lightning.pytorch.utilities import rank_zero_only
from torch import nn

from ..te_availability import gpu_fp8_capable, te_module, te_status
from .engine import Engine
from .mlp_fusion import MLPChain, fuse_block, mlp_chains
from .norm_fusion import FusedNorm, fusable_pairs, keep_norm_keys
from .policy import find_blocks, is_conv1d, runs_bf16
from .recipes import RECIPES
from .scaling_state import (drop_foreign_extra_state, export_fp8_scaling, import_fp8_scaling,
                            strip_extra_state, te_modules)

log = logging.getLogger(__name__)


def make_te_recipe(config: dict[str, Any]) -> Any:
    """The TransformerEngine recipe object for a validated config."""
    from transformer_engine.common import recipe as te_recipe

    kwargs = {k: v for k, v in config.items() if k != "recipe"}
    kwargs["fp8_format"] = getattr(te_recipe.Format, kwargs["fp8_format"].upper())
    return getattr(te_recipe, RECIPES[config["recipe"]].builds)(**kwargs)


def recipe_available(recipe: str) -> tuple[bool, str]:
    """Can TE ``recipe`` run here? Asks TE itself (``is_*_available(return_reason=True)``)."""
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


def _sharded(module: nn.Module) -> bool:
    """FSDP2 sharded the module's weight: swapped, FSDP2 would keep gathering into the old one."""
    from torch.distributed.tensor import DTensor

    return isinstance(module.weight, DTensor)


def te_gemm_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Named TE modules that run GEMMs (and so can run FP8)."""
    modules = te_modules(model)
    if not modules:
        return {}
    attention = te_module().DotProductAttention
    return {name: m for name, m in modules.items() if not isinstance(m, attention)}


def te_linear_like(linear: nn.Linear, norm: Optional[nn.LayerNorm] = None) -> nn.Module:
    """A ``te.Linear`` holding ``linear``'s own parameters: the same ``weight`` / ``bias`` objects
    under the same names, so an optimizer made before (Fabric), weight tying and the user's
    checkpoints keep working. Built on the meta device: nothing is allocated twice. With
    ``norm``: a ``te.LayerNormLinear`` holding the norm's parameters too (:mod:`.norm_fusion`)."""
    te = te_module()
    weight = linear.weight
    kwargs = dict(bias=linear.bias is not None, params_dtype=weight.dtype, device="meta")
    if norm is None:
        new = te.Linear(linear.in_features, linear.out_features, **kwargs)
    else:
        new = te.LayerNormLinear(linear.in_features, linear.out_features, eps=norm.eps,
                                 normalization="LayerNorm", **kwargs)
        new.layer_norm_weight, new.layer_norm_bias = norm.weight, norm.bias
    new.weight = weight
    _hold_bias(new, "bias", linear.bias, weight)
    new.train(linear.training)
    return new


def _hold_bias(new: nn.Module, name: str, bias: Optional[nn.Parameter], weight: nn.Parameter
               ) -> None:
    """A TE module built on meta takes the user's bias, or, where there is none, the empty
    tensor TE keeps instead (on the weight's device, not meta)."""
    setattr(new, name, bias if bias is not None else
            torch.empty(0, dtype=weight.dtype, device=weight.device))


def te_mlp_like(norm: nn.LayerNorm, fc1: nn.Linear, fc2: nn.Linear) -> nn.Module:
    """A ``te.LayerNormMLP`` (GELU, TE's tanh approximation) holding a user's norm's, fc1's and
    fc2's own parameters (:mod:`.mlp_fusion`), built on the meta device as
    :func:`te_linear_like`."""
    weight = fc1.weight
    new = te_module().LayerNormMLP(fc1.in_features, fc1.out_features, eps=norm.eps,
                                   bias=fc1.bias is not None, normalization="LayerNorm",
                                   activation="gelu", params_dtype=weight.dtype, device="meta")
    new.layer_norm_weight, new.layer_norm_bias = norm.weight, norm.bias
    new.fc1_weight, new.fc2_weight = fc1.weight, fc2.weight
    _hold_bias(new, "fc1_bias", fc1.bias, weight)
    _hold_bias(new, "fc2_bias", fc2.bias, weight)
    new.train(fc1.training)
    return new


def drop_extra_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook of a ``te.Linear`` swapped in for a user's ``nn.Linear``: no
    ``_extra_state`` key, so the checkpoint has the user's model's keys exactly (its FP8
    scaling state is in the plugin's own state)."""
    state_dict.pop(prefix + "_extra_state", None)


def expect_no_extra_state(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """Load pre-hook of a swapped ``te.Linear``: a checkpoint of the user's model has no
    ``_extra_state`` key; an empty one is what TE reads as "nothing to restore"."""
    state_dict.setdefault(prefix + "_extra_state", torch.empty(0, dtype=torch.uint8))


class TEEngine(Engine):
    """TE modules run FP8 inside ``te.autocast(recipe)``; the policy's BF16 modules open a
    ``te.autocast(enabled=False)`` region around their forward."""

    name, backend = "te", "te"
    swaps_modules = True

    def __init__(self) -> None:
        self.recipe: Any = None
        # the TE layers convert() put in a user's model (a set-up again swaps none: kept)
        self.swapped: list[nn.Module] = []

    def available(self, recipe: str) -> tuple[bool, str]:
        return recipe_available(recipe)

    def gemm_modules(self, model: nn.Module) -> dict[str, nn.Module]:
        """TE's GEMM modules (model.backend: te) and any other model's ``nn.Linear`` modules,
        which :meth:`convert` swaps for ``te.Linear`` where they run FP8."""
        return {**te_gemm_modules(model),
                **{name: m for name, m in model.named_modules() if type(m) is nn.Linear}}

    def cannot_convert(self, model: nn.Module) -> Optional[str]:
        """A user's model whose layers the swap for ``te.Linear`` cannot serve (the torchao
        engine converts them in place, so it can): Hugging Face ``Conv1D``, a model FSDP2
        sharded before the swap, Hugging Face gradient checkpointing."""
        from torch.distributed.tensor import DTensor

        modules = list(model.modules())
        if any(is_conv1d(m) for m in modules):
            return ("the model's GEMMs are Hugging Face Conv1D layers (weights stored (in, out)), "
                    "which TE's Linear does not take; use a torchao recipe (recipe: tensorwise)")
        if not any(type(m) is nn.Linear for m in modules):
            return None  # TE's own modules (model.backend: te): nothing to swap
        if any(isinstance(p, DTensor) for p in model.parameters()) and not te_gemm_modules(model):
            # FSDP2 keeps each parameter's owning module and would keep gathering into the
            # replaced nn.Linear. (A model swapped before its sharding, fitted again, has its
            # te.Linear layers already; its sharded nn.Linear, which convert leaves, ran BF16.)
            return ("the model's nn.Linear layers were sharded (FSDP2) before FP8 could swap them "
                    "for te.Linear; use a torchao recipe (recipe: tensorwise), which converts "
                    "them in place")
        if getattr(model, "is_gradient_checkpointing", False):
            # the recompute runs in the backward, outside te.autocast: not the forward's FP8
            return ("the model recomputes its layers in the backward (Hugging Face gradient "
                    "checkpointing), outside TE's FP8 region; use a torchao recipe "
                    "(recipe: tensorwise), or turn the checkpointing off")
        return None

    def time_gemm(self, gemm: Any, tokens: int, config: Optional[dict[str, Any]],
                  reps: int = 10) -> float:
        """GPU ms of one forward + backward of a ``te.Linear`` of ``gemm``'s shape
        (:class:`~.gemm_timing.Gemm`) at ``tokens`` tokens: FP8 under the recipe ``config``
        (:func:`~.recipes.build_recipe_config`), BF16 when it is None."""
        from .gemm_timing import time_gemm

        return time_gemm(gemm, tokens, None if config is None else make_te_recipe(config),
                         reps=reps)

    def speed_note(self, model: nn.Module, bf16_modules: dict[str, str]) -> Optional[str]:
        """A user's model of plain ``nn.Linear`` layers that :meth:`convert` swaps: swapped
        ``te.Linear`` layers gain little over the model's compiled BF16 (docs/benchmarks.md,
        "Your own model under FP8Precision"); this package's TE model, with its fused layers,
        gains far more."""
        if not any(type(m) is nn.Linear and not runs_bf16(name, bf16_modules)
                   for name, m in self.gemm_modules(model).items()):
            return None
        return ("TE runs this model's nn.Linear layers as TE modules (te.Linear, or one "
                "te.LayerNormLinear with the LayerNorm before it): only "
                "the GEMMs and the fused ops run FP8, so FP8 gains less over the same model's "
                "compiled BF16 than on this package's GPT, and may gain nothing. Accumulate "
                "several micro-batches per optimizer step (the FP8 weights are then cast once per "
                "optimizer step), try the torchao engine where the blocks are not graphed "
                "(engine='torchao' compiles the whole model), and compare with the model's "
                "compiled BF16 before a long run: docs/benchmarks.md, 'Your own model under "
                "FP8Precision'")

    def auto_bf16(self, gemm_modules: dict[str, nn.Module], keep: dict[str, str],
                  config: dict[str, Any], tokens: Optional[int]) -> tuple[dict[str, str], str]:
        """Each distinct GEMM shape timed in TE FP8 and in BF16 on this GPU; a module whose
        GEMMs together are not faster in FP8 stays BF16."""
        from .gemm_timing import Gemm, time_gemm
        from .policy import slower_in_fp8

        recipe = make_te_recipe(config)  # built once for every shape
        measured_tokens = tokens or 8 * 1024

        def time_shape(shape: tuple[int, int], fp8: bool) -> float:
            gemm = Gemm(f"{shape[1]}->{shape[0]}", shape[1], shape[0], bias=False)
            return time_gemm(gemm, measured_tokens, recipe if fp8 else None)

        how = (f"at {measured_tokens} tokens per micro-batch"
               + ("" if tokens else " (assumed: the micro-batch is unknown)"))
        return slower_in_fp8(gemm_modules, keep, time_shape), how

    def convert(self, model: nn.Module, config: dict[str, Any],
                bf16_modules: dict[str, str], fuse_mlp: Optional[bool] = False) -> list[Any]:
        te = te_module()
        self.recipe = make_te_recipe(config)
        hooks = []
        # A user's nn.Linear that runs FP8 becomes a te.Linear with the same parameters (TE
        # runs FP8 only in its own modules), or a te.LayerNormLinear with the LayerNorm before
        # it where nothing else reads the norm's output; those kept BF16 stay nn.Linear.
        wanted = [name for name, module in self.gemm_modules(model).items()
                  if type(module) is nn.Linear and not runs_bf16(name, bf16_modules)]
        swap = [name for name in wanted if not _sharded(model.get_submodule(name))]
        if len(swap) < len(wanted):  # a model sharded before this fit, its policy now looser
            rank_zero_only(log.warning)(
                "TE: %d nn.Linear layers stay BF16: FSDP2 sharded them before they could be "
                "swapped for te.Linear (%s); build the model anew, or keep the policy of the fit "
                "that swapped it", len(wanted) - len(swap),
                ", ".join(n for n in wanted if n not in swap))
        # found on the user's blocks before anything is swapped (fx traces them)
        prefix, chains = (self._mlp_chains(model, swap, quiet=fuse_mlp is None)
                          if fuse_mlp is not False else ("", []))
        fc1s = {f"{prefix}.{c.block}.{c.fc1}" for c in chains}
        norms = self._fusable_norms(model, [name for name in swap if name not in fc1s])
        for fused in self._fuse_mlps(model, prefix, chains):
            self.swapped.append(fused)
            fused.register_state_dict_post_hook(drop_extra_state)
            fused.register_load_state_dict_pre_hook(expect_no_extra_state)
        swap = [name for name in swap if type(model.get_submodule(name)) is nn.Linear]
        for name in swap:
            module = model.get_submodule(name)
            parent, _, attr = name.rpartition(".")
            if name in norms:
                norm_parent, _, norm_attr = norms[name].rpartition(".")
                norm = model.get_submodule(norms[name])
                swapped = te_linear_like(module, norm)
                keep_norm_keys(swapped)
                setattr(model.get_submodule(norm_parent), norm_attr, FusedNorm(norm, name))
            else:
                swapped = te_linear_like(module)
            setattr(model.get_submodule(parent), attr, swapped)
            self.swapped.append(swapped)
            # kept for the module's life (the swap is permanent): not among the hooks returned
            swapped.register_state_dict_post_hook(drop_extra_state)
            swapped.register_load_state_dict_pre_hook(expect_no_extra_state)
        modules = dict(model.named_modules())
        for name in bf16_modules:
            active: list[Any] = []  # the open te.autocast(enabled=False) region of this module

            def enter(_mod, _args, active=active):
                region = te.autocast(enabled=False)
                region.__enter__()
                active.append(region)

            def leave(_mod, _args, _out, active=active):
                if active:
                    active.pop().__exit__(None, None, None)

            hooks.append(modules[name].register_forward_pre_hook(enter))
            hooks.append(modules[name].register_forward_hook(leave, always_call=True))
        for module in te_modules(model).values():
            hooks.append(module.register_state_dict_post_hook(strip_extra_state))
            hooks.append(module.register_load_state_dict_pre_hook(drop_foreign_extra_state))
        return hooks

    def _mlp_chains(self, model: nn.Module, swap: list[str], quiet: bool = False
                    ) -> tuple[str, list[MLPChain]]:
        """``fuse_mlp``: the blocks' chains whose two linears run FP8 (:mod:`.mlp_fusion`),
        said once in the log (none found: said only where asked for, not ``quiet``)."""
        prefix, n = find_blocks(model)
        if not n or not swap or te_modules(model):
            return prefix, []
        chains, why = mlp_chains(model.get_submodule(prefix))
        chains = [c for c in chains if {f"{prefix}.{c.block}.{c.fc1}",
                                        f"{prefix}.{c.block}.{c.fc2}"} <= set(swap)]
        if chains:
            c = chains[0]
            rank_zero_only(log.info)("TE: %d MLPs found for te.LayerNormMLP (norm, GEMM, GELU, "
                                     "GEMM in one module), e.g. %s.%d: %s -> %s -> gelu -> %s",
                                     len(chains), prefix, c.block, c.norm, c.fc1, c.fc2)
        elif not quiet:
            rank_zero_only(log.info)("TE: fuse_mlp: no MLP fused (%s)",
                                     why or "their linears stay BF16")
        return prefix, chains

    @staticmethod
    def _fuse_mlps(model: nn.Module, prefix: str, chains: list[MLPChain]) -> list[nn.Module]:
        """The chains as te.LayerNormMLP modules, block by block; returns them."""
        by_block: dict[int, list[MLPChain]] = {}
        for chain in chains:
            by_block.setdefault(chain.block, []).append(chain)
        fused, refused = [], []
        for i, block_chains in by_block.items():
            modules, why = fuse_block(model.get_submodule(f"{prefix}.{i}"), block_chains,
                                      f"{prefix}.{i}", te_mlp_like)
            fused += modules
            if why:
                refused.append(why)
        if refused:
            rank_zero_only(log.info)("TE: fuse_mlp: %d block(s) keep their MLP: %s",
                                     len(refused), "; ".join(refused[:3]))
        return fused

    @staticmethod
    def _fusable_norms(model: nn.Module, swap: list[str]) -> dict[str, str]:
        """``{linear name: norm name}``: the swapped linears whose LayerNorm TE computes with
        them (:mod:`.norm_fusion`), said once in the log."""
        prefix, n = find_blocks(model)
        if not n or not swap or te_modules(model):  # TE's own blocks fuse their norms already
            return {}
        pairs, why = fusable_pairs(model.get_submodule(prefix), prefix)
        pairs = {linear: norm for linear, norm in pairs.items() if linear in swap}
        if pairs:
            rank_zero_only(log.info)("TE: %d LayerNorms computed by the GEMM after them "
                                     "(te.LayerNormLinear), e.g. %s -> %s", len(pairs),
                                     *next(iter((v, k) for k, v in pairs.items())))
        else:
            rank_zero_only(log.info)("TE: no LayerNorm computed by a GEMM module (%s)",
                                     why or "their linears stay BF16")
        return pairs

    def context(self, fp8: bool, amax_group: Any = None) -> Any:
        return te_module().autocast(enabled=fp8, recipe=self.recipe,
                                    amax_reduction_group=amax_group)

    def modules_ran(self, model: Optional[nn.Module]) -> list[str]:
        """TE sets ``module.fp8`` on every forward."""
        if model is None:
            return []
        return [name for name, m in te_gemm_modules(model).items() if getattr(m, "fp8", False)]

    def reset_scaling(self, model: nn.Module) -> None:
        for module in te_modules(model).values():
            module.reset_fp8_meta_tensors()

    def export_scaling(self, model: nn.Module) -> dict[str, dict[str, Any]]:
        return export_fp8_scaling(model)

    def import_scaling(self, model: nn.Module, scaling: dict[str, dict[str, Any]]) -> int:
        return import_fp8_scaling(model, scaling, self.recipe)


def fp8_modules_ran(model: Optional[nn.Module]) -> list[str]:
    """TE modules whose last forward ran FP8."""
    return TEEngine().modules_ran(model)
