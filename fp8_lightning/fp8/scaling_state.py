"""FP8 scaling state in checkpoints, with no pickle (TransformerEngine's delayed scaling).

TE >= 2.18 refuses to unpickle ``_extra_state`` without ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``:
this package never writes pickles. When it saves, every TE module's ``_extra_state`` is replaced
by an empty tensor and the delayed-scaling amax history and scales are stored as plain tensors in
the plugin's own state (loadable with ``torch.load(weights_only=True)``); when it loads, it copies
them back through TE's ``reset_fp8_meta_tensors``. A foreign checkpoint's pickled extra state is
dropped with a warning (the scales recalibrate within ``amax_history_len`` steps) unless the user
set the TE variable themselves, in which case TE loads it as TE would.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import nn

from ..te_availability import te_status

log = logging.getLogger(__name__)


def te_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Named TE modules that carry FP8 metadata (GEMM modules and ``DotProductAttention``)."""
    if not te_status()[0]:
        return {}
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    return {name: m for name, m in model.named_modules()
            if isinstance(m, TransformerEngineBaseModule)}


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


def _gemms(module: Any) -> Any:
    """How many GEMMs' scales a TE module keeps (None: not checked, e.g. attention)."""
    from transformer_engine.pytorch import LayerNormLinear, LayerNormMLP, Linear

    if isinstance(module, LayerNormMLP):
        return 2
    return 1 if isinstance(module, (Linear, LayerNormLinear)) else None


def import_fp8_scaling(model: nn.Module, scaling: dict[str, dict[str, Any]], recipe: Any) -> int:
    """Copy exported delayed-scaling tensors back into TE modules; returns modules restored."""
    restored, skipped = 0, []
    modules = te_modules(model)
    for name, saved in scaling.items():
        module = modules.get(name)
        # a GEMM module of another kind under the name (a te.Linear saved, a te.LayerNormMLP
        # now: fuse_mlp changed) has another number of GEMMs, whose scales TE indexes
        gemms = _gemms(module)
        if module is None or saved["amax_history_fwd"].shape[0] != recipe.amax_history_len or \
                (gemms is not None and saved["num_gemms"] != gemms):
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
        log.warning("FP8 scaling state not restored for %d module(s) (missing, another layer "
                    "type or a different amax_history_len): %s; they recalibrate", len(skipped),
                    ", ".join(skipped[:5]))
    log.info("FP8 scaling state restored for %d TE modules", restored)
    return restored


def strip_extra_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook: no pickled TE extra state in our checkpoints (the plugin stores it)."""
    key = prefix + "_extra_state"
    if key in state_dict:
        state_dict[key] = torch.empty(0, dtype=torch.uint8)


def drop_foreign_extra_state(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """Load pre-hook: a pickled extra state we did not write is dropped unless the user opted in."""
    from transformer_engine.pytorch._extra_state import (UNSAFE_PICKLE_EXTRA_STATE_ENV,
                                                          unsafe_pickle_extra_state_enabled)

    key = prefix + "_extra_state"
    value = state_dict.get(key)
    if isinstance(value, torch.Tensor) and value.numel() > 0 and not unsafe_pickle_extra_state_enabled():
        state_dict[key] = torch.empty(0, dtype=torch.uint8)
        rank_zero_only(log.warning)(f"{prefix.rstrip('.')}: ignoring pickled FP8 extra state from a checkpoint "
                       f"not written by fp8-lightning (unsafe to unpickle); the FP8 scales "
                       f"recalibrate. Set {UNSAFE_PICKLE_EXTRA_STATE_ENV}=1 only if you trust it.")
