"""Will this run fit? GPU memory per device from the model's shape, before the first step.

A run that does not fit must say so before training, with what would make it fit, not as an
out-of-memory trace after minutes of setup (Llama-3-8B on two H200s is the case that matters:
fp32 master weights, gradients and AdamW state are 16 bytes a parameter, 128 GB at 8B).

The estimate counts, per GPU:

- **weights**: fp32 master copies (4 B/param), sharded over the FSDP2 group; plus the
  per-step working copies: BF16 casts of the weights autocast keeps for the step (2 B/param, one
  gathered block at a time under FSDP2), or TE's FP8 weights and their transposes (2 B/param);
- **gradients**: fp32 (4 B/param), sharded;
- **optimizer**: AdamW's two fp32 moments (8 B/param), sharded;
- **activations**: what autograd keeps for the backward of one micro-batch. Per token and block
  (h = n_embd, q = the fused QKV width, f = the MLP width, f1 = fc1's output, 2f for SwiGLU;
  r = the residual stream's bytes, 2 or 4): the QKV module's input and norm output (r + g) h,
  q, k, v before and after RoPE/QK-norm 4q, attention's output 2h (and its FP8 copy for the
  output projection), the MLP's input and norm output (r + g) h, fc1's output 2 f1 and the
  activation g f, where g is 1 for a GEMM input kept in FP8, else 2. Flash attention keeps no
  T x T matrix. ``full`` activation checkpointing keeps a checkpointed block's input (r h) and
  recomputes one block at a time; ``mlp`` drops the MLP's norm output, fc1 output and activation.
  The LM head's logits, their gradient and the loss's softmax: 3 x 2 B x padded vocabulary.

Measured against ``torch.cuda.max_memory_allocated`` by ``tests/test_gpu_memory.py`` (the figures
are in docs/benchmarks.md). The CUDA context and the allocator's fragmentation are not in it: the
check compares against the memory free *and* already reserved by this process, and needs the
estimate to be below that.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from .config import GPTConfig

GIB = 1024 ** 3


def num_params(config: GPTConfig) -> int:
    """Every parameter (tied embeddings once): embeddings, blocks, norms, LM head."""
    c = config
    h, q, f = c.n_embd, c.qkv_width, c.ffn_hidden
    f1 = 2 * f if c.activation == "swiglu" else f
    norm = h * (2 if c.norm == "layernorm" else 1)
    block = h * q + h * h + h * f1 + f * h + 2 * norm
    if c.bias:
        block += q + h + f1 + h
    if c.qk_norm:
        block += 2 * c.head_dim
    embeddings = c.padded_vocab_size * h * (1 if c.tie_embeddings else 2)
    if c.position == "learned":
        embeddings += c.block_size * h
    return c.n_layer * block + embeddings + norm


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU."""

    weights: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        # The backward frees activations as it writes gradients (set to None after each
        # step): the two peak together at about the larger of them, not their sum.
        return self.weights + self.optimizer + max(self.gradients, self.activations)

    def describe(self) -> str:
        parts = ", ".join(f"{name} {getattr(self, name) / GIB:.1f}" for name in
                          ("weights", "gradients", "optimizer", "activations"))
        return f"{self.total / GIB:.1f} GiB per GPU ({parts})"


@dataclass(frozen=True)
class RunShape:
    """What besides the model decides the memory of a training step."""

    batch_size: int
    seq_len: int
    shards: int = 1  # the FSDP2 group's size (1: every GPU holds everything, as DDP does)
    fp8: bool = False  # TE FP8: GEMM inputs kept in FP8 for the backward
    fp32_residual: bool = False
    activation_checkpointing: str = "none"
    activation_checkpointing_every: int = 1


def estimate_memory(config: GPTConfig, run: RunShape) -> MemoryEstimate:
    """The peak bytes per GPU of one training step (see the module docstring for the terms)."""
    c = config
    params = num_params(c)
    per_block = params / max(1, c.n_layer)
    gathered = 2 * per_block * min(2, c.n_layer) if run.shards > 1 else 2 * params
    h, q, f = c.n_embd, c.qkv_width, c.ffn_hidden
    f1 = 2 * f if c.activation == "swiglu" else f
    r = 4 if run.fp32_residual else 2
    g = 1 if run.fp8 else 2
    attention = (r + g) * h + 2 * q + 2 * h + (h if run.fp8 else 0)
    mlp_inner = g * h + 2 * f1 + g * f
    mlp = r * h + mlp_inner
    block = attention + mlp  # bytes per token
    checkpointed = len(range(0, c.n_layer, run.activation_checkpointing_every))
    if run.activation_checkpointing == "full":
        kept = checkpointed * r * h + (c.n_layer - checkpointed) * block + block  # + one recompute
    elif run.activation_checkpointing == "mlp":
        kept = c.n_layer * block - checkpointed * mlp_inner + mlp_inner
    else:
        kept = c.n_layer * block
    tokens = run.batch_size * run.seq_len
    # The BF16 logits (the compiled loss writes their gradient into the same buffer); final norm.
    head = 2 * c.padded_vocab_size + 2 * r * h
    return MemoryEstimate(weights=4 * params / run.shards + gathered,
                          gradients=4 * params / run.shards, optimizer=8 * params / run.shards,
                          activations=tokens * (kept + head))


def fit_problem(config: GPTConfig, run: RunShape, budget: float, gpus: int = 1) -> Optional[str]:
    """None if the estimate fits in ``budget`` bytes, else the problem with the levers that
    would make it fit (each checked with the estimate), for an ``error:`` line."""
    estimate = estimate_memory(config, run)
    if estimate.total <= budget:
        return None
    levers = []
    if run.activation_checkpointing != "full" or run.activation_checkpointing_every > 1:
        full = replace(run, activation_checkpointing="full", activation_checkpointing_every=1)
        levers.append(("model.activation_checkpointing: full", full))
    if run.batch_size > 1:
        levers.append((f"data.batch_size: {run.batch_size // 2}",
                       replace(run, batch_size=run.batch_size // 2)))
    more = max(2, run.shards * 2, gpus)  # the fewest GPUs (doubling, to 64) that would do
    while more < 64 and estimate_memory(config, replace(run, shards=more)).total > budget:
        more *= 2
    levers.append((f"FSDP2 over {more} GPUs (--config configs/fsdp.yaml, trainer.devices: {more})",
                   replace(run, shards=more)))
    said = []
    for name, shape in levers:
        total = estimate_memory(config, shape).total
        said.append(f"{name} -> {total / GIB:.1f} GiB{'' if total <= budget else ' (not enough)'}")
    return (f"the run needs about {estimate.describe()} but {budget / GIB:.1f} GiB is free on the "
            f"GPU; levers: {'; '.join(said)}")
