"""Model FLOPs per token and the peak-FLOPs table behind throughput and MFU.

Training FLOPs per token (the PaLM appendix B convention, as in nanoGPT's ``estimate_mfu``)::

    6 * N_matmul + 12 * n_layer * seq_len * n_embd

``N_matmul`` are the weights every token multiplies: the blocks' projections (QKV, output, MLP)
*and the LM head* (``padded_vocab_size x n_embd``, counted even when tied to the embedding, since
the head is a real GEMM: ~31% of GPT-2 124M's matmul FLOPs). Embedding lookups, norms and biases
are left out. ``6 = 2`` (multiply-add) ``x 3`` (forward, input-grad, weight-grad). The second
term is attention's ``QK^T`` and ``AV`` (``2 * 2 * seq_len * n_embd`` per layer forward, x3),
counted over the full ``T x T`` square as the convention does (no credit for the causal mask).

MFU is reported against the *dense* (no sparsity) BF16 tensor-core peak always, and against the
dense FP8 peak when FP8 is active. Peaks are from NVIDIA's datasheets, matched by device name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .config import GPTConfig


def matmul_params(config: GPTConfig) -> int:
    """Weights multiplied per token: blocks' QKV, output, MLP projections plus the LM head."""
    c = config
    d = c.n_embd
    attn = d * c.qkv_width + c.attn_width * d  # QKV (GQA-aware) and the output projection
    mlp = d * (c.fc1_width + c.ffn_hidden)  # fc1 and fc2
    return c.n_layer * (attn + mlp) + c.padded_vocab_size * d


def flops_per_token(config: GPTConfig, seq_len: Optional[int] = None) -> float:
    """Training (forward + backward) FLOPs per token at sequence length ``seq_len``."""
    seq_len = config.block_size if seq_len is None else seq_len
    return 6.0 * matmul_params(config) + 12.0 * config.n_layer * seq_len * config.n_embd


@dataclass(frozen=True)
class Peak:
    """Dense tensor-core peaks in FLOP/s; ``fp8`` is ``None`` where the GPU has no FP8."""

    name: str
    bf16: float
    fp8: Optional[float]


T = 1e12
# (substrings that must all appear in the lower-cased device name, peak). First match wins, so
# the specific variants (PCIe, NVL) come before the generic name.
PEAKS: list[tuple[tuple[str, ...], Peak]] = [
    (("gb200",), Peak("GB200", 2500 * T, 5000 * T)),
    (("b200",), Peak("B200", 2250 * T, 4500 * T)),
    (("gh200",), Peak("GH200", 989.4 * T, 1978.9 * T)),
    (("h200", "nvl"), Peak("H200 NVL", 835.5 * T, 1671 * T)),
    (("h200",), Peak("H200 SXM", 989.4 * T, 1978.9 * T)),
    (("h100", "pcie"), Peak("H100 PCIe", 756.5 * T, 1513 * T)),
    (("h100", "nvl"), Peak("H100 NVL", 835.5 * T, 1671 * T)),
    (("h100",), Peak("H100 SXM", 989.4 * T, 1978.9 * T)),
    (("h800", "pcie"), Peak("H800 PCIe", 756.5 * T, 1513 * T)),
    (("h800",), Peak("H800 SXM", 989.4 * T, 1978.9 * T)),
    (("h20",), Peak("H20", 148 * T, 296 * T)),
    (("a100",), Peak("A100", 312 * T, None)),
    (("a800",), Peak("A800", 312 * T, None)),
    (("a10g",), Peak("A10G", 70 * T, None)),
    (("a10",), Peak("A10", 125 * T, None)),
    (("l40s",), Peak("L40S", 362.05 * T, 733 * T)),
    (("l40",), Peak("L40", 181 * T, 362 * T)),
    (("l4",), Peak("L4", 121 * T, 242.5 * T)),
    (("rtx 6000 ada",), Peak("RTX 6000 Ada", 364.2 * T, 728.5 * T)),
    (("rtx 4090",), Peak("RTX 4090", 165.2 * T, 330.3 * T)),
]


def peak_for(device_name: str) -> Optional[Peak]:
    """The peak for a CUDA device name such as ``NVIDIA H100 80GB HBM3``; ``None`` if unknown."""
    name = device_name.lower()
    for keys, peak in PEAKS:
        if all(k in name for k in keys):
            return peak
    return None


def mfu(tokens_per_second: float, flops_token: float, peak_flops: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation in [0, 1], or ``None`` without a known peak."""
    if not peak_flops:
        return None
    return tokens_per_second * flops_token / peak_flops
