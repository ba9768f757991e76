"""A user's ``nn.LayerNorm -> nn.Linear`` as one TE ``LayerNormLinear`` (TE engine): the norm
runs inside the GEMM module, whose normalisation kernel writes the GEMM's FP8 input directly (one
norm kernel and one cast kernel fewer per pair, forward and backward), as in this package's own
GPT. Safe only where the norm's output feeds that one ``nn.Linear`` and nothing else, which only
the block's traced graph (``torch.fx``) tells; a block fx cannot trace keeps its norms."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn


def fusable_norm(module: nn.Module) -> bool:
    """An ``nn.LayerNorm`` TE's ``LayerNormLinear`` computes the same way: over the last
    dimension, with a weight and a bias."""
    return (type(module) is nn.LayerNorm and module.elementwise_affine
            and module.bias is not None and len(module.normalized_shape) == 1)


def fusable_pairs(blocks: nn.ModuleList, prefix: str) -> tuple[dict[str, str], str]:
    """``({linear name: norm name}, why none)`` for the blocks of ``blocks`` (named
    ``<prefix>.<i>`` in the model): every norm called once in its block whose only consumer is
    one ``nn.Linear`` called once, on the norm's output alone."""
    pairs: dict[str, str] = {}
    for i, block in enumerate(blocks):
        try:
            graph = torch.fx.symbolic_trace(block).graph
        except Exception as err:  # data-dependent control flow, kwargs objects, ...: not traced
            return {}, f"{prefix}.{i} cannot be traced by torch.fx ({type(err).__name__})"
        calls = Counter(node.target for node in graph.nodes if node.op == "call_module")
        for node in graph.nodes:
            if node.op != "call_module" or calls[node.target] != 1 or \
                    not fusable_norm(block.get_submodule(node.target)):
                continue
            users = list(node.users)
            if len(users) != 1:
                continue
            user = users[0]
            if user.op != "call_module" or calls[user.target] != 1 or user.args != (node,) or \
                    user.kwargs:
                continue
            linear = block.get_submodule(user.target)
            if type(linear) is nn.Linear and \
                    linear.in_features == block.get_submodule(node.target).normalized_shape[0]:
                pairs[f"{prefix}.{i}.{user.target}"] = f"{prefix}.{i}.{node.target}"
    return pairs, "" if pairs else "no norm feeds one nn.Linear alone"


class FusedNorm(nn.Module):
    """A user's norm whose work the next GEMM module does (``LayerNormLinear``): the identity,
    holding the norm's own parameters under their own names (checkpoints, optimizer)."""

    def __init__(self, norm: nn.LayerNorm, into: str) -> None:
        super().__init__()
        self.weight, self.bias = norm.weight, norm.bias
        self.normalized_shape, self.eps, self.into = norm.normalized_shape, norm.eps, into

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return f"{tuple(self.normalized_shape)}, eps={self.eps}, computed in {self.into}"


def keep_norm_keys(fused: nn.Module) -> None:
    """A ``te.LayerNormLinear`` holding a user's norm's parameters: its state dict leaves out
    the norm's copy (the norm's own key has it) and loads without one."""
    fused.register_state_dict_post_hook(_drop_norm_copy)
    fused.register_load_state_dict_pre_hook(_keep_norm_copy)


def _drop_norm_copy(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    for name in ("layer_norm_weight", "layer_norm_bias"):
        state_dict.pop(prefix + name, None)


def _keep_norm_copy(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    # The norm's own key loads these parameters; the fused module copies them onto themselves.
    for name in ("layer_norm_weight", "layer_norm_bias"):
        state_dict.setdefault(prefix + name, getattr(module, name).detach())
