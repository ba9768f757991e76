"""``python -m fp8_lightning bench``: what FP8 buys on this GPU and this model, measured.

Each variant runs ``warmup + steps`` of ``fit``'s own training step, built through the training
code (:func:`build_step`: ``GPTLightningModule.loss`` with its compile setting, the module's AdamW
and schedule, gradient clipping, the ``FP8Precision`` plugin) on synthetic random tokens already
on the device: data loading and the Trainer's hooks are excluded. Timing uses CUDA events around
the ``steps`` timed steps (``perf_counter`` wall clock on a CPU, where MFU and peak memory are
n/a). ``host ms`` is the CPU time to issue one step while the GPU is kept busy (:func:`host_ms`):
a step whose host time is near its GPU time is host-bound.
FLOPs per token and MFU come from :mod:`fp8_lightning.flops`; speedups are against the baseline
(default: the first variant that ran, ``torch-compile`` in the default list).

Variants are ``<base>[-bf16ends][-te-attn][-fp8-attn][-fp8-head][-eager][-nograph][-fp32res|-bf16res]
[-ac-full|-ac-mlp]``:

* ``torch-eager`` / ``torch-compile``: the PyTorch backend in BF16 autocast, eager or under
  ``torch.compile`` (model + loss, one graph): the strong plain-PyTorch baseline.
* ``te-bf16``: the TransformerEngine backend in BF16 autocast.
* TE variants compile the regions between TE modules and replay each block as a CUDA graph, as
  ``fit`` does on one GPU; ``-eager`` turns compilation off, ``-nograph`` the graphs.
* ``fp8-<recipe>``: TE recipes (``delayed``, ``current``, ``block``, ``mxfp8``) on the TE
  backend, torchao recipes (``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``) on the PyTorch
  backend compiled whole, through :class:`~fp8_lightning.fp8.FP8Precision` exactly as training
  runs it, with the config's layer policy (``fp8_lm_head``, ``bf16_first_layers``, ...) and, for
  the config's own recipe, its fields.
* ``-bf16ends``: the layer policy keeps the first and last block BF16 (FP8 variants only).
* ``-te-attn``: ``te.DotProductAttention`` instead of SDPA (TE variants only).
* ``-fp8-attn``: ``te.DotProductAttention`` with the recipe's ``fp8_dpa`` (attention in FP8;
  delayed and current only); ``-fp8-head``: the LM head in FP8 (``fp8_lm_head``).
* ``-fp32res`` / ``-bf16res``: the residual stream in float32 / in BF16 (``fp32_residual``;
  unset, each backend's default: float32 on the PyTorch backend, BF16 on TE).
* ``-ac-full`` / ``-ac-mlp``: activation checkpointing of every block / of every MLP
  (``model.activation_checkpointing``): the memory it saves and the time it costs.

All variants keep fp32 master weights (``bf16-mixed``), whatever the config's ``weights``.
"""

from __future__ import annotations

import gc
import inspect
import json
import logging
import math
import platform
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, fields, replace
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import yaml

from .config import ConfigError, GPTConfig, check_micro_batch
from .flops import flops_per_token, mfu, peak_for
from .fp8 import BACKEND, RECIPES, REMOVED_KEYS, FP8Precision, get_engine
from .te_support import cpu_has_native_bf16, te_status, te_version

log = logging.getLogger(__name__)

DEFAULT_VARIANTS = ["torch-compile", "torch-eager", "te-bf16", "fp8-delayed", "fp8-current",
                    "fp8-block", "fp8-mxfp8", "te-bf16-te-attn", "fp8-delayed-te-attn",
                    "fp8-delayed-bf16ends", "fp8-tensorwise", "fp8-rowwise"]
# base name -> (backend, FP8 recipe or None, torch.compile)
BASES: dict[str, tuple[str, Optional[str], bool]] = {
    "torch-eager": ("torch", None, False),
    "torch-compile": ("torch", None, True),
    "te-bf16": ("te", None, True),
    **{f"fp8-{r}": (BACKEND[recipe.engine], r, True) for r, recipe in RECIPES.items()},
}
SUFFIXES = ("-bf16ends", "-te-attn", "-fp8-attn", "-fp8-head", "-eager", "-nograph", "-fp32res",
            "-bf16res", "-ac-full", "-ac-mlp")


def method(device: torch.device) -> str:
    """How the figures were measured on ``device`` (the table's last line and ``bench.json``)."""
    cuda = device.type == "cuda"
    return ("fit's training step (GPTLightningModule.loss, its compile setting, AdamW"
            f"{' (fused)' if cuda else ''}, LR schedule, gradient-norm clip {GRADIENT_CLIP}, "
            "zero_grad) on synthetic random tokens already on the device (data loading and Trainer "
            "hooks excluded); fp32 master weights with BF16 autocast; FP8 variants through "
            "FP8Precision (te.autocast); timing: "
            + ("CUDA events" if cuda else "wall clock (time.perf_counter) on the CPU")
            + " over the timed steps after warm-up; FLOPs/token: fp8_lightning.flops (6 * N_matmul"
            " + 12 * n_layer * seq * n_embd); MFU vs the dense BF16 peak"
            + ("" if cuda else " (n/a on a CPU: no peak is known)")
            + ("; host ms: CPU time to issue one step while the GPU is kept busy" if cuda else ""))


# --------------------------------------------------------------------------------- run config
@dataclass
class RunConfig:
    """The parts of a ``fit`` YAML that the bench and the doctor need.

    Args:
        path: the YAML file.
        model: ``model.config`` (``GPTConfig`` fields).
        batch_size: ``data.batch_size``.
        backend: ``model.backend``.
        attention: ``model.attention``.
        fp8: the ``FP8Precision`` ``init_args`` when ``trainer.plugins`` has it, else ``None``.
    """

    path: str
    model: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 8
    backend: str = "auto"
    attention: str = "sdpa"
    fp8: Optional[dict[str, Any]] = None

    def gpt_config(self, n_layer: Optional[int] = None, seq_len: Optional[int] = None) -> GPTConfig:
        """The model config, optionally cut to ``n_layer`` blocks; ``block_size`` grows to
        ``seq_len`` when that is longer."""
        valid = {f.name for f in fields(GPTConfig)}
        unknown = sorted(set(self.model) - valid)
        if unknown:
            raise ConfigError([f"model.config.{k} is not a GPTConfig field; valid: "
                               f"{', '.join(sorted(valid))}" for k in unknown], self.path)
        overrides = dict(self.model)
        if n_layer is not None:
            overrides["n_layer"] = n_layer
        config = GPTConfig(**overrides)
        if seq_len is not None and seq_len > config.block_size:
            overrides["block_size"] = seq_len
            config = GPTConfig(**overrides)
        return config


def _section(parent: dict, key: str, path: str) -> dict:
    value = parent.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError([f"{key} must be a mapping, got {type(value).__name__}"], path)
    return value.get("init_args", value) if "class_path" in value else value


def load_run_config(path: str, model: Optional[str] = None) -> RunConfig:
    """Read a ``fit`` YAML (``configs/*.yaml``) into a :class:`RunConfig`; ``model`` replaces
    its ``model.config.name`` (a preset; the config's other model fields still apply)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError([f"not valid YAML: {err}"], path) from None
    if not isinstance(raw, dict):
        raise ConfigError(["the top level must be a mapping (trainer:, model:, data:)"], path)
    model_args = _section(raw, "model", path)
    data = _section(raw, "data", path)
    trainer = _section(raw, "trainer", path)
    plugins = trainer.get("plugins") or []
    fp8 = None
    for plugin in plugins if isinstance(plugins, list) else [plugins]:
        name = plugin.get("class_path", "") if isinstance(plugin, dict) else str(plugin)
        if name.split(".")[-1] == "FP8Precision":
            fp8 = dict(plugin.get("init_args") or {}) if isinstance(plugin, dict) else {}
    config = model_args.get("config") or {}
    if isinstance(config, dict) and "class_path" in config:
        config = config.get("init_args") or {}
    if not isinstance(config, dict):
        raise ConfigError([f"model.config must be a mapping of GPTConfig fields, got {config!r}"],
                          path)
    config = dict(config, **({"name": model} if model else {}))
    return RunConfig(path=path, model=config, batch_size=data.get("batch_size", 8),
                     backend=model_args.get("backend", "auto"),
                     attention=model_args.get("attention", "sdpa"),
                     fp8=fp8)


# --------------------------------------------------------------------------------- variants
@dataclass(frozen=True)
class Variant:
    """One bench variant (see the module docstring for the names)."""

    name: str
    backend: str
    recipe: Optional[str] = None
    compile: bool = False
    attention: str = "sdpa"
    bf16_ends: bool = False
    graphs: bool = False
    fp8_attention: bool = False
    fp8_head: bool = False
    fp32_residual: Optional[bool] = None  # None: the backend's default
    activation_checkpointing: str = "none"


def parse_variant(name: str) -> Variant:
    """``fp8-delayed-bf16ends-te-attn`` -> ``Variant``; a bad name raises one ``ConfigError``."""
    base, flags = name, set()
    for suffix in SUFFIXES * 4:  # suffixes in any order
        if base not in BASES and base.endswith(suffix):
            base, flags = base[: -len(suffix)], flags | {suffix}
    problems = []
    if base not in BASES:
        problems.append(f"variant {name!r}; valid: {', '.join(BASES)}, optionally followed by "
                        f"-bf16ends, -fp8-attn, -fp8-head (FP8 variants), -te-attn, -eager and "
                        f"-nograph (TE variants)")
    else:
        backend, recipe, compiled = BASES[base]
        if "-te-attn" in flags and backend != "te":
            problems.append(f"variant {name!r}: -te-attn needs a TE variant (te-bf16, fp8-*)")
        for flag in ("-bf16ends", "-fp8-head"):
            if flag in flags and recipe is None:
                problems.append(f"variant {name!r}: {flag} needs an FP8 variant (fp8-*)")
        if "-fp8-attn" in flags and recipe not in ("delayed", "current"):
            problems.append(f"variant {name!r}: -fp8-attn needs fp8-delayed or fp8-current")
        for flag in ("-eager", "-nograph"):
            if flag in flags and backend != "te":
                problems.append(f"variant {name!r}: {flag} needs a TE variant (te-bf16, fp8-*)")
        for pair in (("-fp32res", "-bf16res"), ("-ac-full", "-ac-mlp")):
            if set(pair) <= flags:
                problems.append(f"variant {name!r}: {pair[0]} or {pair[1]}, not both")
    if problems:
        raise ConfigError(problems, "bench --variants")
    return Variant(name, backend, recipe, compiled and "-eager" not in flags,
                   "te" if flags & {"-te-attn", "-fp8-attn"} else "sdpa",
                   "-bf16ends" in flags, backend == "te" and "-nograph" not in flags,
                   "-fp8-attn" in flags, "-fp8-head" in flags,
                   True if "-fp32res" in flags else False if "-bf16res" in flags else None,
                   "full" if "-ac-full" in flags else "mlp" if "-ac-mlp" in flags else "none")


def check_fp8_plugin(fp8: Optional[dict[str, Any]]) -> tuple[Optional[FP8Precision], list[str]]:
    """Build the config's ``FP8Precision`` (pure Python, no GPU): the plugin, or every problem
    with the field it names."""
    if fp8 is None:
        return None, []
    where = "trainer.plugins FP8Precision"
    try:
        return FP8Precision(**fp8), []
    except ConfigError as err:
        return None, [f"{where}: {p}" for p in err.problems]
    except TypeError as err:
        valid = list(inspect.signature(FP8Precision).parameters)
        unknown = [k for k in fp8 if k not in valid]
        return None, [f"{where}: {k}: {REMOVED_KEYS.get(k, 'not an argument')}; valid: "
                      f"{', '.join(valid)}" for k in unknown] or [f"{where}: {err}"]


def positive_int_problems(**values: Any) -> list[str]:
    """``name=value must be a positive integer`` for each value that is not one."""
    return [f"{k}={v!r} must be a positive integer" for k, v in values.items()
            if not isinstance(v, int) or isinstance(v, bool) or v < 1]


def fp8_plugin_args(run: RunConfig, variant: Variant) -> dict[str, Any]:
    """``FP8Precision`` arguments for an FP8 variant: the config's layer policy, its recipe fields
    when the variant runs the config's recipe, and ``on_unavailable="error"``."""
    cfg = dict(run.fp8 or {})
    args: dict[str, Any] = {k: cfg[k] for k in ("fp8_lm_head", "bf16_first_layers",
                                                "bf16_last_layers") if k in cfg}
    if cfg.get("recipe", "delayed") == variant.recipe:
        args.update({k: v for k, v in cfg.items() if k in RECIPES[variant.recipe].defaults})
    if variant.bf16_ends:
        args.update(bf16_first_layers=1, bf16_last_layers=1)
    if variant.fp8_attention:
        args.update(fp8_dpa=True)
    if variant.fp8_head:
        args.update(fp8_lm_head=True)
    return dict(args, recipe=variant.recipe, weights="bf16-mixed", on_unavailable="error")


def skip_reason(variant: Variant, batch_size: int, seq_len: int) -> Optional[str]:
    """Why ``variant`` cannot run here, or ``None``."""
    if variant.backend == "te":
        ok, reason = te_status()
        if not ok:
            return reason
    if variant.recipe is not None:
        ok, reason = get_engine(RECIPES[variant.recipe].engine).available(variant.recipe)
        if not ok:
            return reason
        try:
            check_micro_batch(batch_size, seq_len, field="batch_size")
        except ConfigError as err:
            return "; ".join(err.problems)
    if variant.compile:
        try:
            import torch._dynamo

            if not torch._dynamo.is_dynamo_supported():
                return "torch.compile is not supported on this platform"
        except Exception as err:  # noqa: BLE001 - any failure to import dynamo is a reason
            return f"torch.compile unavailable: {type(err).__name__}: {err}"
    return None


# --------------------------------------------------------------------------------- one variant
GRADIENT_CLIP = 1.0  # the shipped configs' trainer.gradient_clip_val


class _Timer:
    """CUDA events on a GPU, ``perf_counter`` on CPU; milliseconds."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.end_event = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self.start_event.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self.end_event.record()
            self.end_event.synchronize()
            return self.start_event.elapsed_time(self.end_event)
        return (time.perf_counter() - self.t0) * 1e3


def build_step(variant: Variant, config: GPTConfig, batch_size: int, seq_len: int, *,
               device: torch.device, fp8_args: Optional[dict[str, Any]] = None,
               total_steps: int = 100) -> tuple[Callable[[], torch.Tensor], Any]:
    """One ``fit`` training step of ``variant`` on synthetic tokens, built through the training
    code itself: ``GPTLightningModule`` (its loss path and compile setting), its optimizer and
    schedule, gradient-norm clipping as the shipped configs set it, and for FP8 variants the
    ``FP8Precision`` plugin's conversion and step context. Returns ``(step, plugin or None)``."""
    from .module import GPTLightningModule

    if variant.fp32_residual is not None:
        config = replace(config, fp32_residual=variant.fp32_residual)
    module = GPTLightningModule(config, backend=variant.backend, attention=variant.attention,
                                compile=variant.compile, cuda_graphs=None if variant.graphs else False,
                                activation_checkpointing=variant.activation_checkpointing,
                                warmup_steps=min(10, total_steps),
                                lr_decay_steps=total_steps)
    # The Trainer builds the model under the strategy's device context; TE modules go to CUDA.
    with torch.device(device) if variant.backend == "torch" else nullcontext():
        module.configure_model()
    module.to(device).train()
    plugin = None
    if variant.recipe is not None:
        plugin = FP8Precision(**fp8_args)
        module = plugin.convert_module(module)
        context: Callable[[], Any] = plugin.train_step_context
    else:
        context = partial(torch.autocast, device.type, dtype=torch.bfloat16)
    schedule = module.configure_optimizers()
    optimizer, scheduler = schedule["optimizer"], schedule["lr_scheduler"]["scheduler"]
    batch = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), device=device)

    def step() -> torch.Tensor:
        with context():
            loss, _ = module.loss(batch)
        loss.backward()
        module.on_after_backward()
        module.configure_gradient_clipping(optimizer, GRADIENT_CLIP, "norm")
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    step.module = module  # type: ignore[attr-defined]
    return step, plugin


def host_ms(step: Callable[[], Any], device: torch.device, repeats: int = 3
            ) -> tuple[Optional[float], str]:
    """CPU time to issue one step, with the GPU kept busy so the host never waits on it.

    A spin kernel long enough to cover the step is queued first; the host then issues the step.
    If the spin finished before the host did, the host may have waited (a sync in the step, or a
    full launch queue) and the figure is not host time: ``None`` with the reason.
    """
    if device.type != "cuda":
        return None, "host time is the step time on a CPU"
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        torch.cuda._sleep(1_000_000_000)  # ~0.5-0.6 s of spinning at Hopper clocks
        spinning = torch.cuda.Event()
        spinning.record()
        t0 = time.perf_counter()
        step()
        elapsed = (time.perf_counter() - t0) * 1e3
        if spinning.query():
            torch.cuda.synchronize(device)
            return None, "the step waited on the GPU (a host sync or a full launch queue)"
        times.append(elapsed)
        torch.cuda.synchronize(device)
    return sorted(times)[len(times) // 2], "issued while the GPU was busy"


# Kernel-name patterns -> profile category (first match wins), for `bench --profile`.
KERNEL_CATEGORIES = (
    ("attention", ("flash", "fmha", "attn", "sdpa", "cudnn")),
    ("fp8 cast/transpose/amax", ("cast", "transpose", "amax", "quantize", "fp8", "scale")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "matmul")),
    ("loss", ("cross_entropy", "log_softmax", "nll", "logsumexp")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "norm_", "clip")),
)


def kernel_category(name: str) -> str:
    low = name.lower()
    for category, patterns in KERNEL_CATEGORIES:
        if any(p in low for p in patterns):
            return category
    return "other"


def profile_step(step: Callable[[], Any], device: torch.device, steps: int = 3, top: int = 40
                 ) -> tuple[dict[str, float], list[list[Any]]]:
    """GPU kernel time per step by category (ms), from the PyTorch profiler over ``steps``, and
    the ``top`` kernels ([name, category, ms per step, calls per step])."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize(device)
    totals: dict[str, float] = {}
    kernels = []
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us and event.device_type.name == "CUDA":
            category = kernel_category(event.key)
            totals[category] = totals.get(category, 0.0) + us / 1e3 / steps
            kernels.append([event.key[:160], category, round(us / 1e3 / steps, 3),
                            event.count / steps])
    totals["total"] = sum(totals.values())
    kernels.sort(key=lambda k: -k[2])
    return {k: round(v, 3) for k, v in sorted(totals.items())}, kernels[:top]


def host_profile(step: Callable[[], Any], steps: int = 3, top: int = 12) -> list[list[Any]]:
    """Where the host's time goes: the functions with the most own time (cProfile), ms/step."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, nc, tottime, cumtime, ...)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [[f"{Path(f).name}:{line}({name})", round(1e3 * v[2] / steps, 3), v[1] // steps]
            for (f, line, name), v in rows]


def run_variant(variant: Variant, config: GPTConfig, batch_size: int, seq_len: int, *,
                steps: int, warmup: int, device: torch.device,
                fp8_args: Optional[dict[str, Any]] = None, seed: int = 0,
                profile: bool = False) -> dict[str, Any]:
    """Time ``steps`` training steps after ``warmup`` ones; returns the variant's figures.

    Raises whatever the step raises (``torch.OutOfMemoryError`` included): :func:`bench` records it.
    """
    torch.manual_seed(seed)
    start_mem = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        start_mem = torch.cuda.memory_allocated(device)
    step, plugin = build_step(variant, config, batch_size, seq_len, device=device,
                              fp8_args=fp8_args, total_steps=warmup + steps + 8)
    for _ in range(warmup):
        step()
    timer = _Timer(device)
    timer.start()
    for _ in range(steps):
        loss = step()
    ms = timer.stop() / steps
    result: dict[str, Any] = {"loss": loss.item()}
    host, host_note = host_ms(step, device)
    result.update(host_ms=host, host_note=host_note)
    if profile and device.type == "cuda":
        result["profile_ms"], result["profile_kernels"] = profile_step(step, device)
        result["host_profile"] = host_profile(step)
    module = step.module  # type: ignore[attr-defined]
    compiled, graphs = module.compiled, bool(getattr(module._graphs, "active", False))
    result.update(compiled=compiled, cuda_graphs=graphs)
    if plugin is not None:
        result["precision"] = plugin.tag
        result["bf16_modules"] = sorted(plugin.bf16_modules)
        if not plugin.fp8_active:
            return {**result, "status": "skipped", "reason": f"FP8 did not run: {plugin.reason}"}
    else:
        result["precision"] = "BF16"
    result["precision"] += " compiled" * bool(compiled) + " graphs" * graphs
    tok_s = batch_size * seq_len / (ms / 1e3)
    flops = flops_per_token(config, seq_len)
    peak = peak_for(device_name(device))
    result.update(status="ran", ms_per_step=ms, tokens_per_s=tok_s, tflops=tok_s * flops / 1e12,
                  mfu=mfu(tok_s, flops, peak.bf16 if peak else None),
                  peak_mem_gib=((torch.cuda.max_memory_allocated(device) - start_mem) / 2**30
                                if device.type == "cuda" else None))
    if not math.isfinite(result["loss"]):
        result.update(status="failed", reason=f"loss is {result['loss']}", loss=None)
    return result


def measure(variant: Variant, config: GPTConfig, batch_size: int, seq_len: int, *,
            steps: int, warmup: int, device: torch.device,
            fp8_args: Optional[dict[str, Any]] = None, seed: int = 0,
            profile: bool = False) -> dict[str, Any]:
    """:func:`run_variant` that never raises: out of memory is a skip, any other error a
    failure with its reason; the variant's memory is freed before returning."""
    try:
        result = run_variant(variant, config, batch_size, seq_len, steps=steps, warmup=warmup,
                             device=device, fp8_args=fp8_args, seed=seed, profile=profile)
    except Exception as err:  # noqa: BLE001 - one variant's failure must not lose the table
        message = str(err).strip().splitlines()
        if isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower():
            result = {"status": "skipped", "reason": "out of memory"}
        else:
            log.warning("bench variant %s failed", variant.name, exc_info=True)
            result = {"status": "failed",
                      "reason": f"{type(err).__name__}: {message[0] if message else ''}"}
    if variant.compile:
        torch._dynamo.reset()
    free_memory(device)
    if result["status"] == "ran":  # as each finishes: a job killed later keeps these lines
        log.info("bench %s: %.2f ms/step, %.0f tok/s, peak %s GiB", variant.name,
                 result["ms_per_step"], result["tokens_per_s"],
                 "n/a" if result["peak_mem_gib"] is None else f"{result['peak_mem_gib']:.2f}")
    return {"variant": variant.name, "backend": variant.backend, "attention": variant.attention,
            **result}


def free_memory(device: torch.device) -> None:
    """Release what the last variant left: Python garbage, the CUDA cache and TE's global FP8
    state (its delayed-scaling amax buffers keep references to every FP8 module they saw)."""
    gc.collect()
    if device.type == "cuda":
        if te_status()[0]:
            from transformer_engine.pytorch.quantization import FP8GlobalStateManager

            FP8GlobalStateManager.reset()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------- environment
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


def git_commit() -> Optional[str]:
    """The package's git commit (``+dirty`` with uncommitted changes), if it is a checkout."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                                capture_output=True, text=True, timeout=10)
        if commit.returncode:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def command_line() -> str:
    argv = list(sys.argv)
    if argv and argv[0].endswith(("__main__.py", "fp8-lightning")):
        argv = ["python -m fp8_lightning", *argv[1:]]
    return " ".join(argv)


def environment(device: Optional[torch.device] = None) -> dict[str, Any]:
    """Device, software versions, date, git commit and command line (goes into ``bench.json``)."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "device": device_name(device), "python": platform.python_version(),
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformer_engine": te_version(), "git_commit": git_commit(),
           "command": command_line()}
    if device.type == "cuda":
        env["compute_capability"] = "%d.%d" % torch.cuda.get_device_capability(device)
    return env


# --------------------------------------------------------------------------------- report
def _fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"  # None: not measurable here


def _fmt_tflops(value: float) -> str:
    # Two significant digits below 1: a CPU's few GFLOP/s are not "0.00".
    return f"{value:.2f}" if value >= 1 else f"{value:.2g}"


def format_table(report: dict[str, Any]) -> str:
    """The printed table: ran variants, then skipped/failed ones with their reasons."""
    s = report["setup"]
    lines = [f"bench: {s['model']} ({s['n_layer']} layers), batch {s['batch_size']} x seq "
             f"{s['seq_len']}, {s['warmup']} warm-up + {s['steps']} timed steps, on "
             f"{report['env']['device']}; speedup vs {report['baseline'] or '-'}",
             f"{'variant':<26}{'precision':<30}{'tok/s':>12}{'ms/step':>10}{'host ms':>9}"
             f"{'TFLOP/s':>9}{'MFU':>7}{'peak GiB':>9}{'speedup':>9}"]
    skipped = []
    for r in report["results"]:
        if r["status"] != "ran":
            skipped.append(f"  {r['variant']}: {r['status']}: {r['reason']}")
            continue
        lines.append(f"{r['variant']:<26}{r['precision'][:29]:<30}{r['tokens_per_s']:>12,.0f}"
                     f"{r['ms_per_step']:>10.2f}{_fmt(r.get('host_ms'), '.1f'):>9}"
                     f"{_fmt_tflops(r['tflops']):>9}"
                     f"{_fmt(None if r['mfu'] is None else 100 * r['mfu'], '.1f', '%'):>7}"
                     f"{_fmt(r['peak_mem_gib'], '.2f'):>9}{_fmt(r.get('speedup'), '.2f', 'x'):>9}")
    profiled = [r for r in report["results"] if r.get("profile_ms")]
    if profiled:
        categories = sorted({c for r in profiled for c in r["profile_ms"] if c != "total"})
        lines.append("GPU kernel ms per step (profiler), host ms per step:")
        lines.append(f"{'variant':<26}" + "".join(f"{c[:12]:>13}" for c in categories)
                     + f"{'total':>9}{'host':>8}")
        for r in profiled:
            p = r["profile_ms"]
            lines.append(f"{r['variant']:<26}" + "".join(f"{p.get(c, 0.0):>13.2f}" for c in categories)
                         + f"{p['total']:>9.2f}{_fmt(r.get('host_ms'), '.1f'):>8}")
    for r in profiled:
        if r.get("host_profile"):
            lines.append(f"host, {r['variant']}: own ms/step (calls): " + ", ".join(
                f"{name} {ms:.2f} ({calls})" for name, ms, calls in r["host_profile"][:6]))
    if skipped:
        lines += ["not run:", *skipped]
    if report.get("note"):
        lines.append(f"note: {report['note']}")
    lines.append(f"method: {report['method']}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Bar chart of tokens/s per variant (speedup vs the baseline on each bar)."""
    from .compare import pyplot

    plt = pyplot("bench's plot (bench.png)")

    ran = [r for r in report["results"] if r["status"] == "ran"]
    fig, ax = plt.subplots(figsize=(8, 0.5 * max(len(ran), 1) + 1.5))
    names = [r["variant"] for r in ran]
    values = [r["tokens_per_s"] for r in ran]
    bars = ax.barh(names, values, color=["tab:orange" if r["variant"].startswith("fp8") else
                                         "tab:blue" for r in ran])
    for bar, r in zip(bars, ran):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                f" {r['speedup']:.2f}x", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens / s (training, synthetic tokens)")
    s = report["setup"]
    ax.set_title(f"{s['model']} ({s['n_layer']} layers), {s['batch_size']} x {s['seq_len']} on "
                 f"{report['env']['device']}", fontsize=9)
    ax.margins(x=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bench(config: str, variants: Union[list[str], str, None] = None, steps: int = 20,
          warmup: int = 5, model: Optional[str] = None, batch_size: Optional[int] = None,
          seq_len: Optional[int] = None, n_layer: Optional[int] = None,
          baseline: Optional[str] = None, output_dir: str = "bench_out",
          seed: int = 0, profile: bool = False) -> dict[str, Any]:
    """Time training-step variants of a config's model and report tok/s, MFU, memory, speedup.

    Args:
        config: a ``fit`` YAML (``configs/*.yaml``): model, ``data.batch_size``, FP8 plugin args.
        variants: variants to run, in order (comma-separated or a list); default: all of
            torch-compile, torch-eager, te-bf16, fp8-delayed, fp8-current, fp8-block, fp8-mxfp8,
            te-bf16-te-attn, fp8-delayed-te-attn, fp8-delayed-bf16ends. Those that cannot run
            here are listed as skipped with the reason.
        steps: timed training steps per variant.
        warmup: untimed steps first (compilation, FP8 scale calibration, cuBLAS autotuning).
        model: a preset replacing the config's ``model.config.name`` (e.g. ``gpt-1.3b``).
        batch_size: sequences per step (default: the config's ``data.batch_size``).
        seq_len: tokens per sequence (default: the model's ``block_size``).
        n_layer: cut the model to this many blocks (to fit big models on one GPU).
        baseline: the variant speedups are relative to (default: the first that ran).
        output_dir: where ``bench.json`` and ``bench.png`` go.
        seed: seed for the weights and the synthetic tokens.
        profile: also profile 3 steps of each variant on the GPU and print the kernel time per
            step by category (GEMM, attention, FP8 cast/transpose/amax, loss, optimizer, other).
    """
    names = DEFAULT_VARIANTS if not variants else variants
    if isinstance(names, str):
        names = [names]
    names = [n.strip() for item in names for n in item.split(",") if n.strip()]
    parsed, problems = [], []
    for name in names:
        try:
            parsed.append(parse_variant(name))
        except ConfigError as err:
            problems += err.problems
    if problems:
        raise ConfigError(problems, "bench --variants")
    # Import TE before any variant touches CUDA: imported after torch.compile has run, TE's core
    # library bound a second cuDNN on the GPU machine (libcudnn_cnn.so.9: undefined symbol).
    te_status()
    run = load_run_config(config, model)
    model_config = run.gpt_config(n_layer=n_layer, seq_len=seq_len)
    batch_size = run.batch_size if batch_size is None else batch_size
    seq_len = model_config.block_size if seq_len is None else seq_len
    problems += positive_int_problems(steps=steps, warmup=warmup, batch_size=batch_size,
                                      seq_len=seq_len)
    problems += check_fp8_plugin(run.fp8)[1]  # before any GPU work, not once per FP8 variant
    if baseline is not None and baseline not in names:
        problems.append(f"baseline={baseline!r} is not among the variants: {', '.join(names)}")
    if problems:
        raise ConfigError(problems, "bench")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = []
    for variant in parsed:
        reason = skip_reason(variant, batch_size, seq_len)
        if reason is not None:
            results.append({"variant": variant.name, "status": "skipped", "reason": reason})
            log.info("bench %s: skipped (%s)", variant.name, reason)
            continue
        log.info("bench %s: %d warm-up + %d steps", variant.name, warmup, steps)
        fp8_args = fp8_plugin_args(run, variant) if variant.recipe else None
        results.append(measure(variant, model_config, batch_size, seq_len, steps=steps,
                               warmup=warmup, device=device, fp8_args=fp8_args, seed=seed,
                               profile=profile))
    ran = {r["variant"]: r for r in results if r["status"] == "ran"}
    base = baseline if baseline in ran else next(iter(ran), None)
    if baseline is not None and base != baseline:
        log.warning("baseline %s did not run; speedups are vs %s", baseline, base)
    for r in ran.values():
        r["speedup"] = ran[base]["ms_per_step"] / r["ms_per_step"]
    report = {"env": environment(device), "method": method(device), "baseline": base,
              "setup": {"config": config, "model": model_config.name, "n_layer": model_config.n_layer,
                        "batch_size": batch_size, "seq_len": seq_len, "steps": steps,
                        "warmup": warmup, "flops_per_token": flops_per_token(model_config, seq_len),
                        "model_config": model_config.to_dict()},
              "results": results}
    if device.type == "cpu" and ran and not cpu_has_native_bf16():
        report["note"] = ("this CPU has no BF16 instructions: BF16 autocast runs emulated, several "
                          "times slower than FP32 (what the FP8 plugin falls back to here)")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    print(format_table(report))
    if ran:  # after the table: without matplotlib (the [plots] extra) it still shows
        plot(report, out / "bench.png")
    print(f"wrote {out / 'bench.json'}" + (f" and {out / 'bench.png'}" if ran else ""))
    return report
