"""``engine: auto``: the FP8 engine and recipe, or BF16, chosen by measuring this model on this GPU.

Each candidate (the TE recipes, the torchao recipes, BF16 compiled) runs a few training steps of
the run's own model and micro-batch through ``bench``'s step (which is ``fit``'s step,
:mod:`fp8_lightning.measure`); the fastest wins. FP8 may lose (small models): then the run
trains BF16 and says so. The training module asks (:func:`choose_engine`, with its own class, so
that nothing here imports it) before it builds its model; the plugin keeps the choice. It lives
beside :mod:`fp8_lightning.measure`, not in :mod:`fp8_lightning.fp8`, which imports nothing above it.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from .fp8.policy import POLICY_FIELDS
from .measure import measure, parse_variant, skip_reason

log = logging.getLogger(__name__)

BF16 = "torch-compile"  # the BF16 candidate: the PyTorch backend compiled whole


def candidates(attention: str) -> list[str]:
    """Bench variant names to probe: TE recipes (with the model's attention), torchao, BF16."""
    te_attn = "-te-attn" if attention == "te" else ""
    return ([f"fp8-{r}{te_attn}" for r in ("delayed", "current", "block")]
            + ["fp8-tensorwise", "fp8-rowwise", BF16])


def choose(timings: dict[str, Optional[float]]) -> tuple[Optional[str], str]:
    """The fastest candidate's recipe (``None``: BF16, or nothing ran) and the figures, fastest
    first (``ms per step``; candidates that could not run are listed as such)."""
    ran = sorted(((ms, name) for name, ms in timings.items() if ms is not None))
    figures = ", ".join(f"{name} {ms:.2f} ms" for ms, name in ran)
    skipped = [name for name, ms in timings.items() if ms is None]
    if skipped:
        figures += f" (could not run: {', '.join(skipped)})"
    if not ran:
        return None, f"no candidate ran{figures}"
    return parse_variant(ran[0][1]).recipe, figures


def probe(config: Any, batch_size: int, seq_len: int, attention: str, module_class: type, *,
          policy: Optional[dict[str, Any]] = None, steps: int = 5, warmup: int = 10
          ) -> dict[str, Optional[float]]:
    """ms per training step of each candidate on this GPU (``None``: it could not run here),
    each FP8 candidate with the run's layer ``policy`` (the plugin's
    :data:`~fp8_lightning.fp8.policy.POLICY_FIELDS`), so that the figure is of what would train.

    ``warmup``: torchao's compiled step runs slow for a few steps after its compilation
    (docs/benchmarks.md, engine choice): the warm-up covers them, so that the probe reads every
    candidate as bench does."""
    device = torch.device("cuda")
    timings: dict[str, Optional[float]] = {}
    for name in candidates(attention):
        variant = parse_variant(name)
        if skip_reason(variant, batch_size, seq_len) is not None:
            timings[name] = None
            continue
        fp8_args = (None if variant.recipe is None else
                    dict(policy or {}, recipe=variant.recipe, on_unavailable="error"))
        result = measure(variant, config, batch_size, seq_len, steps=steps, warmup=warmup,
                         device=device, module_class=module_class, fp8_args=fp8_args)
        timings[name] = result["ms_per_step"] if result["status"] == "ran" else None
        log.info("engine auto: %s %s", name, f"{timings[name]:.2f} ms/step"
                 if timings[name] is not None else result.get("reason"))
    return timings


def choose_engine(plugin: Any, module_class: type, config: Any, batch_size: int, seq_len: int,
                  attention: str, broadcast: Any = None) -> str:
    """``engine: auto``: measure the candidates on this model and micro-batch, give ``plugin``
    the fastest (an FP8 recipe, or BF16), log the figures; returns the model backend it needs.
    With several processes rank zero measures and ``broadcast`` (the strategy's) gives every
    rank its choice: one model on every rank."""
    from lightning.pytorch.utilities import rank_zero_only

    if broadcast is not None:
        choice = None
        if rank_zero_only.rank == 0:
            choose_engine(plugin, module_class, config, batch_size, seq_len, attention)
            choice = (None if plugin.auto_bf16 else plugin.recipe_config["recipe"],
                      plugin.auto_figures)
        plugin.apply_auto_choice(*broadcast(choice))
        return plugin.backend
    if not torch.cuda.is_available():
        plugin.apply_auto_choice(plugin.recipe_config["recipe"], "no GPU: nothing to measure")
    else:
        policy = {key: getattr(plugin, key) for key in POLICY_FIELDS}
        plugin.apply_auto_choice(*choose(probe(config, batch_size, seq_len, attention, module_class,
                                         policy=policy)))
    rank_zero_only(log.info)("engine auto: %s (%s)", "BF16" if plugin.auto_bf16 else
                             f"{plugin.engine.name} {plugin.recipe_config['recipe']}",
                             plugin.auto_figures)
    return plugin.backend
