"""Will this run fit? GPU memory per device from the model's shape, before the first step.

A run that does not fit must say so before training, with what would make it fit, not as an
out-of-memory trace after minutes of setup (Llama-3-8B on two GPUs is the case that matters:
fp32 master weights, gradients and AdamW state are 16 bytes a parameter, 128 GB at 8B).

The estimate counts, per GPU:

- **weights**: the master copies (4 B/param in fp32, 2 in ``bf16-true``), sharded over the
  FSDP2 group; plus the step's working copies of the GEMM weights (BF16 casts under autocast,
  or TE's FP8 weights and their transposes: 2 B per GEMM weight), under FSDP2 those of the two
  blocks gathered at a time (units of several blocks gather more: not counted) and of the root
  (embedding, LM head), which stays gathered, or of every block where the weights stay gathered
  from forward to backward, plus TE's FP8 weights and transposes kept for the backward of every
  block not checkpointed;
- **gradients**: one per parameter in the master dtype, sharded (under FSDP2 the LM head's
  gradient is whole until its reduce-scatter);
- **optimizer**: AdamW's two moments in the master dtype, sharded;
- **activations**: what autograd keeps for the backward of one micro-batch. Per token and block
  (h = n_embd, q = the fused QKV width, f = the MLP width, f1 = fc1's output, 2f for SwiGLU;
  r = the residual stream's bytes, 2 or 4; g = 1 for a GEMM input TE keeps in FP8, else 2):
  the QKV module's input and norm output (r + g) h, attention's q, k, v 2q and output 2h (and
  its FP8 copy for the output projection, h), the MLP's input and norm output (r + g) h, fc1's
  output 2 f1 and the activation g f. Flash attention keeps no T x T matrix. ``full`` activation
  checkpointing keeps a checkpointed block's input (r h), plus one block recomputed at a time;
  ``mlp`` drops the MLP's norm output, fc1 output and activation. The head: the BF16 logits
  (2 B x padded vocabulary; the compiled loss writes their gradient into the same buffer; the
  eager loss adds its fp32 copy and softmax gradient, 8 B more).

The backward frees activations while it writes gradients, and the LM head's gradient comes
first: the peak is ``weights + optimizer + max(activations + head gradient, gradients)``, or
their sum under gradient accumulation (the gradients of the earlier micro-batches are held) and
under FSDP2's whole-step CUDA graph (it adds into gradients that stay allocated).
That holds where gradients are freed between steps: the module drops them right after the
optimizer step (Lightning alone keeps them through the next step's forward). DDP's gradient
buckets and the CUDA graphs' static gradients stay allocated; the one-GPU and DDP checks below
ran with them.

Checked against ``torch.cuda.max_memory_allocated`` (bench's peak of the same step;
``tests/test_gpu_bench.py``; the figures: docs/benchmarks.md, peak memory): close for compiled
BF16, further off for TE FP8, mostly high (it keeps fewer activations than counted). The CUDA
context and the allocator's fragmentation are not in it: the check compares with the memory free
*and* already reserved by this process.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Optional

from .config import GPTConfig
from .flops import matmul_params
from .model import checkpointed_blocks

GIB = 1024 ** 3


def num_params(config: GPTConfig) -> int:
    """Every parameter (tied embeddings once): the GEMM weights (:func:`matmul_params`: blocks
    and LM head), the embeddings, norms and biases."""
    c = config
    h = c.n_embd
    norm = h * (2 if c.norm == "layernorm" else 1)
    per_block = (2 * norm + (c.qkv_width if c.qkv_bias else 0)
                 + (h + c.fc1_width + h if c.bias else 0))
    per_block += 2 * c.head_dim if c.qk_norm else 0
    embeddings = 0 if c.tie_embeddings else c.padded_vocab_size * h  # tied: the head's weight
    embeddings += c.block_size * h if c.position == "learned" else 0
    return matmul_params(c) + c.n_layer * per_block + embeddings + norm


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU; ``total`` is the step's peak (the module docstring says how)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    head_gradient: float = 0.0  # the LM head's, written first in the backward
    gradients_held: bool = False  # through the forward (accumulation, FSDP2's step graph)

    @property
    def total(self) -> float:
        if self.gradients_held:
            return self.weights + self.optimizer + self.gradients + self.activations
        return self.weights + self.optimizer + max(self.activations + self.head_gradient,
                                                   self.gradients)

    def describe(self) -> str:
        parts = ", ".join(f"{name} {getattr(self, name) / GIB:.1f}" for name in
                          ("weights", "gradients", "optimizer", "activations"))
        how = "all four" if self.gradients_held else "weights + optimizer + the larger of " \
              "activations and gradients"
        return f"{self.total / GIB:.1f} GiB per GPU ({parts}; peak: {how})"


@dataclass(frozen=True)
class RunShape:
    """What besides the model decides the memory of a training step."""

    batch_size: int
    seq_len: int
    shards: int = 1  # the FSDP2 group's size (1: every GPU holds everything, as DDP does)
    keep_gathered: bool = False  # FSDP2 without reshard after forward: every block's weights
    fp8: bool = False  # TE FP8: GEMM inputs kept in FP8 for the backward
    fp32_residual: bool = False
    activation_checkpointing: str = "none"
    activation_checkpointing_every: int = 1
    master_bytes: int = 4  # 4: fp32 master weights (bf16-mixed); 2: bf16-true
    compiled_loss: bool = True  # False: the eager loss materialises fp32 logits
    accumulate_grad_batches: int = 1
    gradients_kept: bool = False  # held through the next forward (FSDP2's step graph, if it fits)


def estimate_memory(config: GPTConfig, run: RunShape) -> MemoryEstimate:
    """The peak bytes per GPU of one training step (see the module docstring for the terms)."""
    c = config
    params, gemm = num_params(c), matmul_params(c)
    h, q, f = c.n_embd, c.qkv_width, c.ffn_hidden
    head_params = c.padded_vocab_size * h
    if run.shards > 1 and run.keep_gathered:  # every block's BF16 weights, forward to backward
        working = 2 * params
    elif run.shards > 1:  # two blocks gathered at a time, the root (embedding, head) throughout
        root = head_params * (1 if c.tie_embeddings else 2)
        working = 2 * (2 * (params - root) / max(1, c.n_layer) + root)
    else:  # the GEMM weights' BF16 (or FP8) copies; the embedding lookup takes no copy
        working = 2 * gemm
    f1 = c.fc1_width
    checkpointed = len(checkpointed_blocks(c.n_layer, run.activation_checkpointing_every))
    if run.shards > 1 and run.fp8:
        # TE keeps each GEMM's FP8 weight and its transpose for the backward of every block whose
        # forward it keeps; under FSDP2 they are copies of gathered weights, beside the shards
        # (on one GPU they are the working copies above). A recomputed block has its own.
        attn_w, mlp_w = h * q + c.attn_width * h, h * (f1 + f)
        if run.activation_checkpointing == "full":
            kept_w = (c.n_layer - checkpointed + min(1, checkpointed)) * (attn_w + mlp_w)
        elif run.activation_checkpointing == "mlp":
            kept_w = c.n_layer * attn_w + (c.n_layer - checkpointed + min(1, checkpointed)) * mlp_w
        else:
            kept_w = c.n_layer * (attn_w + mlp_w)
        working += 2 * kept_w
    r = 4 if run.fp32_residual else 2
    g = 1 if run.fp8 else 2
    aw = c.attn_width  # attention's output: the output projection's input
    attention = (r + g) * h + 2 * q + 2 * aw + (aw if run.fp8 else 0)
    mlp_inner = g * h + 2 * f1 + g * f
    block = attention + r * h + mlp_inner  # bytes per token
    if run.activation_checkpointing == "full":
        kept = checkpointed * r * h + (c.n_layer - checkpointed) * block
        if checkpointed == c.n_layer:  # every block: one recomputed at a time on top
            kept += block
    elif run.activation_checkpointing == "mlp":
        kept = c.n_layer * block - checkpointed * mlp_inner + mlp_inner
    else:
        kept = c.n_layer * block
    logits = c.padded_vocab_size * (2 if run.compiled_loss else 10)
    tokens = run.batch_size * run.seq_len
    state = params / run.shards  # parameters held per GPU
    return MemoryEstimate(weights=run.master_bytes * state + working,
                          gradients=run.master_bytes * state,
                          optimizer=2 * run.master_bytes * state,
                          activations=tokens * (kept + logits + 2 * r * h),  # + the final norm
                          # the LM head's gradient: whole (not yet reduce-scattered) under FSDP2
                          head_gradient=run.master_bytes * head_params,
                          gradients_held=run.accumulate_grad_batches > 1 or run.gradients_kept)


def fit_problem(config: GPTConfig, run: RunShape, budget: float, gpus: int = 1,
                several_nodes: bool = False) -> Optional[str]:
    """None if the estimate fits in ``budget`` bytes, else the problem with the levers that
    would make it fit (each checked with the estimate), for an ``error:`` line.
    ``several_nodes``: the run spans nodes or replicates (HSDP), where FSDP2Strategy's default
    keeps a replica per node: sharding over more GPUs needs ``replicate: 1`` as well."""
    estimate = estimate_memory(config, run)
    if estimate.total <= budget:
        return None

    @functools.cache  # each shape is estimated once (the levers are checked, then reported)
    def total(shape: RunShape) -> float:
        return estimate_memory(config, shape).total

    def fits(shape: RunShape) -> bool:
        return total(shape) <= budget

    def fewest_gpus(shape: RunShape) -> Optional[int]:  # doubling, up to 64; None: none do
        n = max(2, run.shards * 2, gpus)
        while n <= 64 and not fits(replace(shape, shards=n)):
            n *= 2
        return n if n <= 64 else None

    def fsdp(n: int) -> str:
        one_replica = "trainer.strategy.init_args.replicate: 1"
        if several_nodes and n == gpus:  # HSDP: sharding over every GPU there is
            return f"FSDP2 over all {n} GPUs, one replica ({one_replica})"
        return (f"FSDP2 over {n} GPUs (--config configs/fsdp.yaml; trainer.devices x "
                f"trainer.num_nodes = {n}" + (f", {one_replica}" if several_nodes else "") + ")")

    full = replace(run, activation_checkpointing="full", activation_checkpointing_every=1)
    mlp = replace(run, activation_checkpointing="mlp", activation_checkpointing_every=1)
    every = ", model.activation_checkpointing_every: 1" if run.activation_checkpointing_every != 1 \
        else ""  # (the levers' estimates checkpoint every block)
    levers = []
    # mlp first where it is enough: it recomputes less than full
    if run.activation_checkpointing != "full" and mlp != run and fits(mlp):
        levers.append((f"model.activation_checkpointing: mlp{every}", mlp))
    if full != run:
        levers.append((f"model.activation_checkpointing: full{every}", full))
    if run.batch_size > 1:
        levers.append((f"data.batch_size: {run.batch_size // 2}",
                       replace(run, batch_size=run.batch_size // 2)))
    alone = fewest_gpus(run)  # sharding divides the state, not the activations
    if alone:
        levers.append((fsdp(alone), replace(run, shards=alone)))
    if full != run and not any(fits(shape) for _, shape in levers):
        both = fewest_gpus(full)  # neither lever alone: together
        if both:
            levers.append((f"model.activation_checkpointing: full and {fsdp(both)}",
                           replace(full, shards=both)))
    said = [f"{name} -> {total(shape) / GIB:.1f} GiB{'' if fits(shape) else ' (not enough)'}"
            for name, shape in levers]
    return (f"the run needs about {estimate.describe()} but {budget / GIB:.1f} GiB is free on the "
            f"GPU; levers: {'; '.join(said)}")
