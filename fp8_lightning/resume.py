"""What a checkpoint carries for a resume beside the weights, and what resuming checks: the
model it was trained with (one error naming every field that differs), the random generators'
states (saved as tensors and plain types, restored on load)."""

from __future__ import annotations

import random
from typing import Any

import torch

from .config import ConfigError, GPTConfig


def check_same_model(saved: dict[str, Any], config: GPTConfig) -> None:
    """One error listing every model field where this run differs from the checkpoint."""
    current = config.to_dict()
    unknown = [k for k in saved if k not in current]
    if unknown:  # not "model.config.X=None but ...": this version has no such field
        GPTConfig.from_dict(saved, "model config recorded in the checkpoint")
    problems = [f"model.config.{k}={current.get(k)!r} but the checkpoint was trained with "
                f"{k}={v!r}" for k, v in saved.items() if k != "name" and current.get(k) != v]
    if problems:
        raise ConfigError(problems + ["set these fields as in the checkpoint (the config saved "
                                      "beside it: config.yaml) or start without --ckpt_path"],
                          "model for this checkpoint")


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch (and CUDA) generator states as tensors and plain types."""
    import numpy as np

    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` saved (CUDA's only on as many GPUs as it was saved on)."""
    import numpy as np

    random.setstate(tuple(state["python"][:1]) + (tuple(state["python"][1]),)
                    + tuple(state["python"][2:]))
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
