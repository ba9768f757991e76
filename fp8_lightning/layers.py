"""A small layer factory: the same four layers from TransformerEngine or from plain PyTorch.

Both backends expose identical parameter names, shapes and ``state_dict`` keys (TE's names:
``layer_norm_weight``, ``weight``, ``fc1_weight``, ... and an ``_extra_state`` entry per module),
so one model definition serves both and a checkpoint written by one loads into the other.
The ``torch`` layers are the reference semantics of TE's fused modules: they run anywhere (CPU CI,
GPUs without TE) and are the BF16 fallback.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from .config import fc1_width
from .te_availability import te_module

InitFn = Callable[[torch.Tensor], torch.Tensor]


def normal_init(std: float) -> InitFn:
    return partial(nn.init.normal_, mean=0.0, std=std)


class _NoExtraState:
    """Gives a plain module TE's ``_extra_state`` key (empty), so state_dict keys match TE's.

    Loading ignores whatever TE stored there: FP8 scaling state means nothing without FP8.
    """

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: object) -> None:
        pass


def _norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], kind: str,
          eps: float) -> torch.Tensor:
    if kind == "rmsnorm":  # in fp32, as TE does (and as autocast does for layer_norm)
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class _Gemms:
    """The torch layers' matrix products: ``F.linear``, or the float8 GEMM that an FP8 engine
    (:mod:`fp8_lightning.fp8.torchao_engine`) puts in ``float8`` for this module. The engine
    finds these layers by that empty class attribute."""

    float8: Optional[Callable[..., torch.Tensor]] = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.float8 is None:
            return F.linear(x, weight, bias)
        return self.float8(x, weight, bias)


def runs_float8(model: nn.Module) -> bool:
    """Does any of ``model``'s PyTorch GEMM layers (or a user's ``nn.Linear`` the torchao engine
    converted) run an FP8 engine's float8 GEMM now?"""
    return any(getattr(m, "float8", None) is not None for m in model.modules())


class TorchNorm(_NoExtraState, nn.Module):
    """``te.LayerNorm`` / ``te.RMSNorm``: parameters ``weight`` (and ``bias`` for LayerNorm)."""

    def __init__(self, hidden: int, *, kind: str, eps: float) -> None:
        super().__init__()
        self.kind, self.eps = kind, eps
        self.weight = nn.Parameter(torch.ones(hidden))
        self.bias = nn.Parameter(torch.zeros(hidden)) if kind == "layernorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _norm(x, self.weight, self.bias, self.kind, self.eps)


class TorchLinear(_NoExtraState, _Gemms, nn.Module):
    """``te.Linear``: parameters ``weight`` (out, in) and optional ``bias``."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool,
                 init_method: InitFn) -> None:
        super().__init__()
        self.weight = nn.Parameter(init_method(torch.empty(out_features, in_features)))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.weight, self.bias)


class TorchLayerNormLinear(_NoExtraState, _Gemms, nn.Module):
    """``te.LayerNormLinear``: ``layer_norm_weight``/``layer_norm_bias`` then ``weight``/``bias``."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, norm: str, eps: float,
                 init_method: InitFn) -> None:
        super().__init__()
        self.kind, self.eps = norm, eps
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features))
        self.layer_norm_bias = nn.Parameter(torch.zeros(in_features)) if norm == "layernorm" else None
        self.weight = nn.Parameter(init_method(torch.empty(out_features, in_features)))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _norm(x, self.layer_norm_weight, self.layer_norm_bias, self.kind, self.eps)
        return self.linear(x, self.weight, self.bias)


class TorchLayerNormMLP(_NoExtraState, _Gemms, nn.Module):
    """``te.LayerNormMLP``: norm, ``fc1``, activation, ``fc2``.

    GELU is the tanh approximation (TE's and GPT-2's). SwiGLU follows TE's convention: ``fc1``
    produces [gate, up] and the gate is the *first* half (PyTorch's GLU gates the second).
    """

    def __init__(self, hidden: int, ffn_hidden: int, *, bias: bool, norm: str, eps: float,
                 activation: str, init_method: InitFn, output_layer_init_method: InitFn,
                 checkpoint: bool = False) -> None:
        super().__init__()
        self.kind, self.eps, self.activation = norm, eps, activation
        self.checkpoint = checkpoint  # TE's name: recompute the MLP's activations in backward
        fc1_out = fc1_width(ffn_hidden, activation)
        self.layer_norm_weight = nn.Parameter(torch.ones(hidden))
        self.layer_norm_bias = nn.Parameter(torch.zeros(hidden)) if norm == "layernorm" else None
        self.fc1_weight = nn.Parameter(init_method(torch.empty(fc1_out, hidden)))
        self.fc1_bias = nn.Parameter(torch.zeros(fc1_out)) if bias else None
        self.fc2_weight = nn.Parameter(output_layer_init_method(torch.empty(hidden, ffn_hidden)))
        self.fc2_bias = nn.Parameter(torch.zeros(hidden)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint and torch.is_grad_enabled():
            # Keeps only x; TE's LayerNormMLP(checkpoint=True) also skips fc2 on the recompute,
            # this reference recomputes it (one GEMM more, the same memory).
            return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _norm(x, self.layer_norm_weight, self.layer_norm_bias, self.kind, self.eps)
        h = self.linear(x, self.fc1_weight, self.fc1_bias)
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.linear(h, self.fc2_weight, self.fc2_bias)


class SDPAttention(_NoExtraState, nn.Module):
    """Causal attention through ``F.scaled_dot_product_attention`` (flash / cuDNN / math)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, T, nh, hs = q.shape
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs) / (B, nkv, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=k.shape[1] != nh)  # (B, nh, T, hs)
        return y.transpose(1, 2).reshape(B, T, nh * hs)  # (B, T, C)


class LayerFactory:
    """Builds the model's layers for one backend: ``"torch"`` or ``"te"`` (TransformerEngine).

    Args:
        backend: ``"torch"`` or ``"te"``.
        attention: ``"sdpa"`` (default, both backends) or ``"te"`` (``te.DotProductAttention``).
        device: where TE allocates parameters (TE modules default to CUDA).
    """

    def __init__(self, backend: str, attention: str = "sdpa",
                 device: Optional[torch.device | str] = None) -> None:
        if backend not in ("torch", "te"):
            raise ValueError(f"backend={backend!r}; valid: 'torch', 'te'")
        if attention not in ("sdpa", "te"):
            raise ValueError(f"attention={attention!r}; valid: 'sdpa', 'te'")
        if attention == "te" and backend != "te":
            raise ValueError("attention='te' (te.DotProductAttention) needs backend='te'")
        self.backend, self.attention = backend, attention
        self.te = te_module() if backend == "te" else None
        self.device = device if device is not None else ("cuda" if backend == "te" else None)

    def _te_kwargs(self) -> dict:
        return dict(params_dtype=torch.get_default_dtype(), device=self.device)

    @staticmethod
    def _te_norm_name(kind: str) -> str:
        return "RMSNorm" if kind == "rmsnorm" else "LayerNorm"

    def norm(self, hidden: int, *, kind: str, eps: float) -> nn.Module:
        if self.te is None:
            return TorchNorm(hidden, kind=kind, eps=eps)
        cls = self.te.RMSNorm if kind == "rmsnorm" else self.te.LayerNorm
        return cls(hidden, eps=eps, device=self.device, dtype=torch.get_default_dtype())

    def linear(self, in_features: int, out_features: int, *, bias: bool,
               init_method: InitFn) -> nn.Module:
        if self.te is None:
            return TorchLinear(in_features, out_features, bias=bias, init_method=init_method)
        return self.te.Linear(in_features, out_features, bias=bias, init_method=init_method,
                              **self._te_kwargs())

    def norm_linear(self, in_features: int, out_features: int, *, bias: bool, norm: str,
                    eps: float, init_method: InitFn) -> nn.Module:
        if self.te is None:
            return TorchLayerNormLinear(in_features, out_features, bias=bias, norm=norm, eps=eps,
                                        init_method=init_method)
        return self.te.LayerNormLinear(in_features, out_features, eps=eps, bias=bias,
                                       normalization=self._te_norm_name(norm),
                                       init_method=init_method, **self._te_kwargs())

    def norm_mlp(self, hidden: int, ffn_hidden: int, *, bias: bool, norm: str, eps: float,
                 activation: str, init_method: InitFn, output_layer_init_method: InitFn,
                 checkpoint: bool = False) -> nn.Module:
        """``checkpoint``: selective activation checkpointing, the MLP's norm output, fc1 output
        and activation recomputed in the backward instead of kept (TE's own option)."""
        if self.te is None:
            return TorchLayerNormMLP(hidden, ffn_hidden, bias=bias, norm=norm, eps=eps,
                                     activation=activation, init_method=init_method,
                                     output_layer_init_method=output_layer_init_method,
                                     checkpoint=checkpoint)
        return self.te.LayerNormMLP(hidden, ffn_hidden, eps=eps, bias=bias,
                                    normalization=self._te_norm_name(norm), activation=activation,
                                    init_method=init_method,
                                    output_layer_init_method=output_layer_init_method,
                                    checkpoint=checkpoint, **self._te_kwargs())


    def core_attention(self, n_head: int, n_kv_heads: int, head_dim: int) -> nn.Module:
        if self.attention == "sdpa":
            return SDPAttention()
        return self.te.DotProductAttention(num_attention_heads=n_head, kv_channels=head_dim,
                                           num_gqa_groups=n_kv_heads, attention_dropout=0.0,
                                           attn_mask_type="causal", qkv_format="bshd")


def checkpoint(backend: str, function: Callable[..., torch.Tensor], *args: Any, **kwargs: Any
               ) -> torch.Tensor:
    """``function(*args, **kwargs)`` keeping only its inputs for the backward, which recomputes
    the rest: full activation checkpointing. On TE, ``te.checkpoint``: its recompute runs with
    the forward's FP8 scales and does not update the amax history a second time. Non-reentrant
    (autograd's saved-tensor hooks): what FSDP2 and torch.compile support."""
    if backend == "te":
        return te_module().checkpoint(function, *args, use_reentrant=False, **kwargs)
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def residual_std(n_layer: int) -> float:
    """GPT-2: residual projections are scaled by 1/sqrt(2 * n_layer)."""
    return 0.02 / math.sqrt(2 * n_layer)
