"""Model configuration: one ``GPTConfig`` dataclass and a table of named presets.

``GPTConfig(name="gpt2", n_layer=4)`` starts from the ``gpt2`` preset and overrides one field;
every field left at ``None`` is taken from the preset. ``GPTConfig.from_name`` is the same thing
spelled the litgpt way. Validation collects every problem and raises one ``ConfigError``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, Optional

log = logging.getLogger(__name__)

# FP8 GEMMs (cuBLASLt) need both dims of each operand to be multiples of 16.
FP8_MULTIPLE = 16
# Pad the vocabulary to a multiple of 128: the LM head is the largest GEMM of a small GPT and
# 50257 rows makes it slow (and illegal for FP8); 50304 = 393 * 128.
VOCAB_MULTIPLE = 128

_GPT2 = dict(
    vocab_size=50257, block_size=1024, norm="layernorm", activation="gelu", position="learned",
    bias=True, tie_embeddings=True, qk_norm=False, norm_eps=1e-5, rope_theta=10000.0,
)
_LLAMA3 = dict(
    vocab_size=128256, norm="rmsnorm", activation="swiglu", position="rope", bias=False,
    tie_embeddings=False, qk_norm=False, norm_eps=1e-5, rope_theta=500000.0,
)

PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": dict(_GPT2, n_layer=12, n_head=12, n_embd=768, ffn_hidden=3072),
    "gpt2-medium": dict(_GPT2, n_layer=24, n_head=16, n_embd=1024, ffn_hidden=4096),
    "gpt2-large": dict(_GPT2, n_layer=36, n_head=20, n_embd=1280, ffn_hidden=5120),
    "gpt2-xl": dict(_GPT2, n_layer=48, n_head=25, n_embd=1600, ffn_hidden=6400),
    # The 1.3B GPT of the FP8 literature (GPT-3 XL shape, 24 layers, hidden 2048).
    "gpt-1.3b": dict(_GPT2, n_layer=24, n_head=16, n_embd=2048, ffn_hidden=8192),
    "llama3-8b": dict(_LLAMA3, n_layer=32, n_head=32, n_kv_heads=8, n_embd=4096,
                      ffn_hidden=14336, block_size=8192),
    # Llama 3.2 3B's shape (tied embeddings); the 3B-class model FSDP2 is measured at.
    "llama3.2-3b": dict(_LLAMA3, n_layer=28, n_head=24, n_kv_heads=8, n_embd=3072,
                        ffn_hidden=8192, block_size=8192, tie_embeddings=True),
    "llama3-small": dict(_LLAMA3, n_layer=12, n_head=16, n_kv_heads=4, n_embd=2048,
                         ffn_hidden=5504, block_size=2048),
    # Small enough for a 2-core CPU; every dim still a multiple of 16 so it also runs FP8.
    "tiny": dict(_GPT2, n_layer=2, n_head=4, n_embd=64, ffn_hidden=256, block_size=128),
    "tiny-llama": dict(_LLAMA3, vocab_size=50257, n_layer=2, n_head=4, n_kv_heads=2, n_embd=64,
                       ffn_hidden=160, block_size=128, qk_norm=True),
}


class ConfigError(ValueError):
    """A configuration is invalid; the message lists every problem with a valid alternative."""

    def __init__(self, problems: list[str], where: str = "config") -> None:
        self.problems = problems
        super().__init__(f"invalid {where}:\n  - " + "\n  - ".join(problems))


class UsageError(SystemExit):
    """Bad command-line input found by a parser: one ``error:`` line, exit status 2.

    A ``SystemExit`` (as a parser's own exit is), so no ``except Exception`` on the way out
    swallows it; ``fp8_lightning.cli.main`` prints the message."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message


def nearest_multiple(value: int, multiple: int) -> int:
    """The multiple of ``multiple`` closest to ``value`` (never below ``multiple``)."""
    return max(multiple, int(round(value / multiple)) * multiple)


def fc1_width(ffn_hidden: int, activation: Optional[str]) -> int:
    """fc1's output width: [gate, up] for SwiGLU (twice ffn_hidden), else ffn_hidden (TE's
    ``LayerNormMLP`` and its PyTorch twin)."""
    return 2 * ffn_hidden if activation == "swiglu" else ffn_hidden


ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings")


def rope_scaling_problems(scaling: Any, position: Optional[str]) -> list[str]:
    """What is wrong with a ``rope_scaling`` value (none: empty): Llama 3's type and its four
    positive numbers, the high-frequency factor above the low one."""
    if scaling is None:
        return []
    valid = ("valid: {rope_type: llama3, " + ", ".join(f"{k}: <number>" for k in ROPE_SCALING_KEYS)
             + "} or unset")
    if not isinstance(scaling, dict) or scaling.get("rope_type") != "llama3":
        return [f"rope_scaling={scaling!r}; {valid}"]
    problems = [f"rope_scaling.{k}={scaling.get(k)!r} must be a positive number"
                for k in ROPE_SCALING_KEYS
                if isinstance(scaling.get(k), bool) or not isinstance(scaling.get(k), (int, float))
                or scaling[k] <= 0]
    extra = sorted(set(scaling) - {"rope_type", *ROPE_SCALING_KEYS})
    if extra:
        problems.append(f"rope_scaling has unknown keys {extra}; {valid}")
    if not problems and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        problems.append(f"rope_scaling.high_freq_factor={scaling['high_freq_factor']} must be "
                        f"above low_freq_factor={scaling['low_freq_factor']}")
    if position != "rope":
        problems.append(f"rope_scaling needs position=rope, not {position!r}")
    return problems


@dataclass
class GPTConfig:
    """A GPT-2 or Llama-style decoder. Fields left ``None`` come from the preset ``name``."""

    name: str = "gpt2"
    """Preset to start from: gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt-1.3b, llama3-8b,
    llama3-small, tiny, tiny-llama."""
    vocab_size: Optional[int] = None
    """Tokenizer vocabulary (GPT-2: 50257). The embedding and LM head are padded beyond it."""
    block_size: Optional[int] = None
    """Maximum sequence length."""
    n_layer: Optional[int] = None
    n_head: Optional[int] = None
    n_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention (default: n_head, i.e. multi-head)."""
    n_embd: Optional[int] = None
    head_size: Optional[int] = None
    """The attention head dim when it is not n_embd / n_head (Hugging Face's ``head_dim``, e.g.
    Mistral Nemo's 128 at n_embd 5120 and 32 heads); unset: n_embd / n_head."""
    ffn_hidden: Optional[int] = None
    """MLP hidden width (per branch for SwiGLU)."""
    norm: Optional[Literal["layernorm", "rmsnorm"]] = None
    activation: Optional[Literal["gelu", "swiglu"]] = None
    position: Optional[Literal["learned", "rope"]] = None
    rope_theta: Optional[float] = None
    rope_scaling: Optional[dict[str, Any]] = None
    """Llama 3.1/3.2's RoPE frequency scaling: ``{rope_type: llama3, factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings}`` (unset: plain RoPE, as Llama 3.0)."""
    qk_norm: Optional[bool] = None
    """RMSNorm on queries and keys per head (stabilises low-precision attention logits)."""
    bias: Optional[bool] = None
    qkv_bias: Optional[bool] = None
    """A bias on the QKV projection (Qwen2's, without the other biases); unset: ``bias``."""
    tie_embeddings: Optional[bool] = None
    norm_eps: Optional[float] = None
    fp32_residual: Optional[bool] = None
    """Carry the residual stream in float32 under autocast (the embedding's dtype, as nanoGPT
    does). Unset: yes on the torch backend; no on the TE backend, which carries it in the
    autocast dtype as TE's TransformerLayer and Megatron-LM do: half the traffic in every residual
    add and norm and no per-block casts (measured: docs/benchmarks.md, the residual stream on
    the TE engine)."""
    padded_vocab_size: Optional[int] = None
    """Derived: vocab_size rounded up to a multiple of 128 (do not set by hand)."""

    def __post_init__(self) -> None:
        if self.name not in PRESETS:
            raise ConfigError([f"name={self.name!r} is not a preset; valid: {', '.join(PRESETS)}"])
        preset = PRESETS[self.name]
        for f in fields(self):
            if getattr(self, f.name) is None and f.name in preset:
                setattr(self, f.name, preset[f.name])
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_head
        if self.qkv_bias is None:
            self.qkv_bias = self.bias
        self.validate()
        padded = -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        if self.padded_vocab_size is not None and self.padded_vocab_size != padded:
            raise ConfigError([f"padded_vocab_size={self.padded_vocab_size} is derived from "
                               f"vocab_size={self.vocab_size}; valid: {padded} (or leave unset)"])
        if self.padded_vocab_size is None and padded != self.vocab_size:
            log.info("padding vocab_size %d -> %d (multiple of %d) for FP8/GEMM-friendly shapes",
                     self.vocab_size, padded, VOCAB_MULTIPLE)
        self.padded_vocab_size = padded

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "GPTConfig":
        return cls(name=name, **overrides)

    @classmethod
    def from_dict(cls, values: dict[str, Any], where: str = "model config") -> "GPTConfig":
        """``GPTConfig(**values)`` for a recorded config (a checkpoint's): fields this version does
        not know are one ``ConfigError`` naming them and the valid ones, not a ``TypeError``."""
        known = [f.name for f in fields(cls)]
        unknown = [str(k) for k in values if k not in known]
        if unknown:
            raise ConfigError([f"{', '.join(unknown)}: not a field of this version's GPTConfig "
                               "(written by another version of fp8-lightning?); valid fields: "
                               + ", ".join(known)], where)
        return cls(**values)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.n_embd // self.n_head

    @property
    def attn_width(self) -> int:
        """The attention output's width, the output projection's input: n_head x head_dim."""
        return self.n_head * self.head_dim

    @property
    def qkv_width(self) -> int:
        return (self.n_head + 2 * self.n_kv_heads) * self.head_dim

    @property
    def fc1_width(self) -> int:
        return fc1_width(self.ffn_hidden, self.activation)

    def residual_in_fp32(self, backend: str) -> bool:
        """``fp32_residual``, or its default for ``backend`` (float32 on torch, BF16 on TE)."""
        return self.fp32_residual if self.fp32_residual is not None else backend == "torch"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def validate(self) -> None:
        """Collect every problem and raise one ``ConfigError``."""
        problems: list[str] = []
        for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_heads", "n_embd",
                    "ffn_hidden"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"{key}={value!r} must be a positive integer")
        choices = {"norm": ("layernorm", "rmsnorm"), "activation": ("gelu", "swiglu"),
                   "position": ("learned", "rope")}
        for key, valid in choices.items():
            if getattr(self, key) not in valid:
                problems.append(f"{key}={getattr(self, key)!r}; valid: {', '.join(valid)}")
        if self.head_size is not None and (not isinstance(self.head_size, int)
                                           or isinstance(self.head_size, bool) or self.head_size <= 0):
            problems.append(f"head_size={self.head_size!r} must be a positive integer or unset")
        if not (isinstance(self.norm_eps, float) and self.norm_eps > 0):
            problems.append(f"norm_eps={self.norm_eps!r} must be a positive float")
        problems += rope_scaling_problems(self.rope_scaling, self.position)
        if problems:  # the dimension checks below need sane integers
            raise ConfigError(problems, f"GPTConfig(name={self.name!r})")

        if self.n_embd % self.n_head and self.head_size is None:
            divisors = [h for h in range(1, self.n_embd + 1) if self.n_embd % h == 0]
            best = min(divisors, key=lambda h: abs(h - self.n_head))
            problems.append(f"n_head={self.n_head} does not divide n_embd={self.n_embd}; "
                            f"nearest valid n_head: {best}")
        if self.n_head % self.n_kv_heads:
            divisors = [h for h in range(1, self.n_head + 1) if self.n_head % h == 0]
            best = min(divisors, key=lambda h: abs(h - self.n_kv_heads))
            problems.append(f"n_kv_heads={self.n_kv_heads} does not divide n_head={self.n_head}; "
                            f"nearest valid n_kv_heads: {best}")
        for key in ("n_embd", "ffn_hidden"):
            value = getattr(self, key)
            if value % FP8_MULTIPLE:
                problems.append(f"{key}={value} is not a multiple of {FP8_MULTIPLE} (FP8 GEMMs "
                                f"need it); nearest valid: {nearest_multiple(value, FP8_MULTIPLE)}")
        if not problems:
            if self.head_dim % FP8_MULTIPLE and self.head_size is not None:
                problems.append(f"head_size={self.head_size} is not a multiple of {FP8_MULTIPLE} "
                                f"(FP8 GEMMs need it); nearest valid: "
                                f"{nearest_multiple(self.head_size, FP8_MULTIPLE)}")
            elif self.head_dim % FP8_MULTIPLE:
                problems.append(
                    f"head dim n_embd/n_head={self.head_dim} is not a multiple of {FP8_MULTIPLE}; "
                    f"nearest valid n_head: {self._nearest_head_count()}")
            elif self.qkv_width % FP8_MULTIPLE:
                problems.append(f"QKV width {self.qkv_width} is not a multiple of {FP8_MULTIPLE}")
        if self.position == "rope" and (self.head_size or self.n_embd % self.n_head == 0) \
                and self.head_dim % 2:
            problems.append(f"RoPE needs an even head dim, got {self.head_dim}")
        if problems:
            raise ConfigError(problems, f"GPTConfig(name={self.name!r})")

    def _nearest_head_count(self) -> int:
        ok = [h for h in range(1, self.n_embd // FP8_MULTIPLE + 1)
              if self.n_embd % h == 0 and (self.n_embd // h) % FP8_MULTIPLE == 0]
        return min(ok, key=lambda h: abs(h - self.n_head)) if ok else 1


def check_micro_batch(batch_size: int, seq_len: int, field: str = "data.batch_size") -> None:
    """FP8 GEMMs see (batch * seq) rows: that product must be a multiple of 16."""
    tokens = batch_size * seq_len
    if tokens % FP8_MULTIPLE:
        step = FP8_MULTIPLE // math.gcd(seq_len, FP8_MULTIPLE)
        raise ConfigError([
            f"{field}={batch_size} x seq_len={seq_len} = {tokens} tokens per micro-batch is not a "
            f"multiple of {FP8_MULTIPLE} (FP8 GEMMs need it); nearest valid {field}: "
            f"{nearest_multiple(batch_size, step)}"], "micro-batch")

