"""The layer policy: the one filter that decides which GEMM modules run FP8 and which stay BF16
(the LM head, the first/last N blocks, any GEMM whose dims FP8 cannot take, and with
``fp8_layers: auto`` the GEMMs too small to gain). Both engines ask it, with the GEMM modules they
would convert. Its answer is ``{name: why}``: a module name (the whole module stays BF16) or, for
``fp8_layers: auto`` on the torchao engine, ``<module>.<weight>`` (that one GEMM of a fused module
stays BF16, e.g. ``blocks.0.mlp.fc2_weight``)."""

from __future__ import annotations

from typing import Callable, Optional

from torch import nn

from ..config import FP8_MULTIPLE


# FP8Precision's fields that make up the layer policy: what bench and engine auto's probe carry
# from a run's plugin into the FP8 variants they time.
POLICY_FIELDS = ("fp8_lm_head", "bf16_first_layers", "bf16_last_layers", "fp8_layers")


def find_gpt(module: nn.Module) -> nn.Module:
    """The GPT inside a LightningModule (``.model``) or the module itself."""
    inner = getattr(module, "model", None)
    return inner if isinstance(inner, nn.Module) else module


def find_blocks(model: nn.Module) -> tuple[str, int]:
    """The model's repeated transformer blocks: (their ``nn.ModuleList``'s name, how many).

    This package's GPT has ``blocks``; another model's are the ``nn.ModuleList`` of two or more
    that holds the most parameters (nanoGPT's ``transformer.h``, Hugging Face Llama's
    ``model.layers``, torchtitan's ``layers``; not a block's list of experts, which can be the
    longer one); ("", 0) when it has none."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return "blocks", len(blocks)
    lists = [(sum(p.numel() for p in m.parameters()), len(m), name)
             for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    if not lists:
        return "", 0
    _, n, name = max(lists, key=lambda x: x[:2])  # the first of the largest
    return name, n


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks :func:`find_blocks` names, in order (none where it finds none): FSDP2's units,
    the modules ``Speedups`` captures as graphs."""
    prefix, n = find_blocks(model)
    return list(model.get_submodule(prefix)) if n else []


def find_lm_head(model: nn.Module) -> Optional[str]:
    """The LM head's module name: ``lm_head`` at any depth (this package, nanoGPT, Hugging
    Face), else a top-level ``output`` (Meta's and torchtitan's Llama); None when neither."""
    names = [name for name, _ in model.named_modules()]
    heads = [n for n in names if n == "lm_head" or n.endswith(".lm_head")]
    if heads:
        return heads[0]
    return "output" if "output" in names else None


def gemm_dims_ok(module: nn.Module) -> bool:
    """Every weight matrix of ``module`` has both dims multiples of 16 (FP8 GEMMs need them)."""
    return all(p.shape[0] % FP8_MULTIPLE == 0 and p.shape[1] % FP8_MULTIPLE == 0
               for p in module.parameters(recurse=False) if p.ndim == 2)


def bf16_module_names(model: nn.Module, gemm_modules: dict[str, nn.Module], *,
                      fp8_lm_head: bool, bf16_first_layers: int,
                      bf16_last_layers: int) -> dict[str, str]:
    """``{module name: why it stays BF16}`` for a model whose GEMM modules are ``gemm_modules``.

    The blocks are :func:`find_blocks`' (``blocks.<i>`` in this package's GPT), the LM head
    :func:`find_lm_head`'s. Every other GEMM module runs FP8 when its dims are multiples of 16.
    """
    keep: dict[str, str] = {}
    prefix, n = find_blocks(model)
    for i in range(n):
        if i < bf16_first_layers:
            keep[f"{prefix}.{i}"] = f"bf16_first_layers={bf16_first_layers}"
        elif i >= n - bf16_last_layers:
            keep[f"{prefix}.{i}"] = f"bf16_last_layers={bf16_last_layers}"
    head = find_lm_head(model)
    if not fp8_lm_head and head is not None:
        keep[head] = "fp8_lm_head=false"
    for name, module in gemm_modules.items():
        if not gemm_dims_ok(module) and not any(name.startswith(k + ".") or name == k for k in keep):
            keep[name] = f"GEMM dims not multiples of {FP8_MULTIPLE}"
    return keep


def runs_bf16(name: str, bf16_modules: dict[str, str]) -> bool:
    """Is module ``name`` inside one the policy keeps BF16?"""
    return any(name == k or name.startswith(k + ".") for k in bf16_modules)


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face GPT-2's ``Conv1D``: a linear layer whose weight is stored (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def gemm_weights(module: nn.Module) -> dict[str, tuple[int, int]]:
    """``{weight name: (out, in)}`` of a GEMM module's own matrices (two for ``LayerNormMLP``;
    Hugging Face's ``Conv1D`` stores its weight (in, out))."""
    flip = is_conv1d(module)
    return {name: tuple(p.shape[::-1] if flip else p.shape)
            for name, p in module.named_parameters(recurse=False) if p.ndim == 2}


def gemm_shapes(module: nn.Module) -> list[tuple[int, int]]:
    """The (out, in) weight shapes of a GEMM module's own matrices (two for ``LayerNormMLP``)."""
    return list(gemm_weights(module).values())


def slower_in_fp8(gemm_modules: dict[str, nn.Module], keep: dict[str, str],
                  time_shape: Callable[[tuple[int, int], bool], float]) -> dict[str, str]:
    """``fp8_layers: auto``: ``{module name: why}`` for the modules not already kept BF16 whose
    GEMMs, timed together, are not faster in FP8. ``time_shape((out, in), fp8)`` returns the
    milliseconds of one forward + backward of that shape at the run's micro-batch (each distinct
    shape is timed once)."""
    times: dict[tuple[tuple[int, int], bool], float] = {}

    def timed(shape: tuple[int, int], fp8: bool) -> float:
        if (shape, fp8) not in times:
            times[shape, fp8] = time_shape(shape, fp8)
        return times[shape, fp8]

    slower = {}
    for name, module in gemm_modules.items():
        if runs_bf16(name, keep):
            continue
        shapes = gemm_shapes(module)
        bf16 = sum(timed(s, False) for s in shapes)
        fp8 = sum(timed(s, True) for s in shapes)
        if fp8 >= bf16:
            dims = ", ".join(f"{i}->{o}" for o, i in shapes)
            slower[name] = f"fp8_layers=auto: FP8 {fp8:.3f} ms >= BF16 {bf16:.3f} ms ({dims})"
    return slower
