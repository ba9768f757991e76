"""Measuring training where it runs: ``fit``'s own step, timed per variant.

The library behind ``bench`` (:mod:`fp8_lightning.commands.bench`), ``doctor``
(:mod:`fp8_lightning.commands.doctor`) and ``engine: auto`` (:mod:`fp8_lightning.engine_auto`): a
variant name (:func:`parse_variant`) says which backend, recipe, attention and options;
:func:`build_step` builds ``fit``'s training step for it through the training module it is
given (``GPTLightningModule``; passed in, so that this module does not import it) and
``FP8Precision``; :func:`measure` times it (CUDA events, host time, peak memory) and never
raises. One GEMM shape is timed by :mod:`fp8_lightning.fp8.gemm_timing`.
"""

from __future__ import annotations

import gc
import logging
import math
import platform
import re
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .config import ConfigError, GPTConfig, check_micro_batch
from .flops import flops_per_token, mfu, peak_for
from .fp8 import RECIPES, FP8Precision, engine_backend, get_engine
from .te_availability import te_status, te_version

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------- variants
DEFAULT_VARIANTS = ["torch-compile", "torch-eager", "te-bf16", "fp8-delayed", "fp8-current",
                    "fp8-block", "fp8-mxfp8", "te-bf16-te-attn", "fp8-delayed-te-attn",
                    "fp8-delayed-bf16ends", "fp8-tensorwise", "fp8-rowwise"]


# base name -> (backend, FP8 recipe or None, torch.compile)
BASES: dict[str, tuple[str, Optional[str], bool]] = {
    "torch-eager": ("torch", None, False),
    "torch-compile": ("torch", None, True),
    "te-bf16": ("te", None, True),
    **{f"fp8-{r}": (engine_backend(recipe.engine), r, True) for r, recipe in RECIPES.items()},
}


SUFFIXES = ("-bf16ends", "-te-attn", "-fp8-attn", "-fp8-head", "-eager", "-nograph", "-fp32res",
            "-bf16res", "-ac-full", "-ac-mlp", "-autolayers", "-alllayers", "-recent",
            "-hist1024")


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
    fp8_layers: Optional[str] = None  # None: the recipe's default (the plugin's)
    amax_history: Optional[str] = None  # recipes.AMAX_HISTORIES' key; None: the config's


def parse_variant(name: str) -> Variant:
    """``fp8-delayed-bf16ends-te-attn`` -> ``Variant``; a bad name raises one ``ConfigError``."""
    base, flags = name, set()
    for suffix in SUFFIXES * 4:  # suffixes in any order
        if base not in BASES and base.endswith(suffix):
            base, flags = base[: -len(suffix)], flags | {suffix}
    problems = []
    if base not in BASES:
        problems.append(f"variant {name!r}; valid: {', '.join(BASES)}, optionally followed by "
                        f"any of {', '.join(SUFFIXES)}")
    else:
        backend, recipe, compiled = BASES[base]
        if "-te-attn" in flags and backend != "te":
            problems.append(f"variant {name!r}: -te-attn needs a TE variant (te-bf16, fp8-*)")
        for flag in ("-bf16ends", "-fp8-head", "-autolayers", "-alllayers"):
            if flag in flags and recipe is None:
                problems.append(f"variant {name!r}: {flag} needs an FP8 variant (fp8-*)")
        for flag in ("-recent", "-hist1024"):
            if flag in flags and recipe != "delayed":
                problems.append(f"variant {name!r}: {flag} needs fp8-delayed (the amax history "
                                "is delayed scaling's)")
        if "-fp8-attn" in flags and recipe not in ("delayed", "current"):
            problems.append(f"variant {name!r}: -fp8-attn needs fp8-delayed or fp8-current")
        if "-eager" in flags and backend != "te":
            problems.append(f"variant {name!r}: -eager needs a TE variant (te-bf16, fp8-*)")
        if "-nograph" in flags and backend != "te" and recipe is None:
            problems.append(f"variant {name!r}: -nograph needs a TE or an FP8 variant "
                            "(te-bf16, fp8-*)")
        for pair in (("-fp32res", "-bf16res"), ("-ac-full", "-ac-mlp"),
                     ("-autolayers", "-alllayers"), ("-recent", "-hist1024")):
            if set(pair) <= flags:
                problems.append(f"variant {name!r}: {pair[0]} or {pair[1]}, not both")
    if problems:
        raise ConfigError(problems, "bench --variants")
    return Variant(name, backend, recipe, compiled and "-eager" not in flags,
                   "te" if flags & {"-te-attn", "-fp8-attn"} else "sdpa",
                   "-bf16ends" in flags,
                   (backend == "te" or recipe is not None) and "-nograph" not in flags,
                   "-fp8-attn" in flags, "-fp8-head" in flags,
                   True if "-fp32res" in flags else False if "-bf16res" in flags else None,
                   "full" if "-ac-full" in flags else "mlp" if "-ac-mlp" in flags else "none",
                   "auto" if "-autolayers" in flags else "all" if "-alllayers" in flags else None,
                   "recent" if "-recent" in flags else "hist1024" if "-hist1024" in flags
                   else None)


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
               device: torch.device, module_class: type, fp8_args: Optional[dict[str, Any]] = None,
               total_steps: int = 100) -> tuple[Callable[[], torch.Tensor], Any]:
    """One ``fit`` training step of ``variant`` on synthetic tokens, built through the training
    code itself: ``module_class`` (``GPTLightningModule``: its loss path and compile setting),
    its optimizer and schedule, gradient-norm clipping as the shipped configs set it, and for FP8
    variants the ``FP8Precision`` plugin's conversion and step context. Returns
    ``(step, plugin or None)``."""
    if variant.fp32_residual is not None:
        config = replace(config, fp32_residual=variant.fp32_residual)
    module = module_class(config, backend=variant.backend, attention=variant.attention,
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
        plugin.tokens_per_micro_batch = batch_size * seq_len  # what fit's module tells it
        module = plugin.convert_module(module)
        context: Callable[[], Any] = plugin.train_step_context
    else:
        context = partial(torch.autocast, device.type, dtype=torch.bfloat16)
    module.plan_graphs()  # as fit's on_train_start: after the plugin's conversion
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
        torch.cuda._sleep(1_000_000_000)  # a billion cycles: to outlast the issue (checked below)
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


# Kernel-name patterns -> profile category (first match wins), for `bench --profile`. GEMMs
# before casts: PyTorch's FP8 _scaled_mm kernels carry "FP8" in their names.
KERNEL_CATEGORIES = (
    ("attention", ("flash", "fmha", "attn", "sdpa", "cudnn")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "matmul")),
    ("fp8 cast/transpose/amax", ("cast", "transpose", "amax", "quantize", "fp8", "scale")),
    ("loss", ("cross_entropy", "log_softmax", "nll", "logsumexp")),
    # the clip's norm kernels (LpNorm, NormTwo), not a compiled LayerNorm's (layer_norm_backward)
    ("optimizer", ("adam", "multi_tensor", "foreach", "lpnorm", "normtwo", "clip")),
)


# PyTorch's elementwise machinery names its dtype handling (gpu_kernel_impl_nocast,
# LoadWithCast/StoreWithoutCast, FSDP2's ..._no_cast_kernel): none of them is an FP8 cast
_NOT_A_CAST = re.compile(r"no_?cast|(load|store)_?with(out)?_?cast")


def kernel_category(name: str) -> str:
    low = _NOT_A_CAST.sub("", name.lower())
    for category, patterns in KERNEL_CATEGORIES:
        if any(p in low for p in patterns):
            return category
    return "other"


def kernel_table(per_kernel: dict[str, tuple[float, float]], top: int
                 ) -> tuple[dict[str, float], list[list[Any]]]:
    """From each kernel's (ms, calls) a step: GPU time by category (ms a step, with ``total``)
    and the ``top`` kernels by time ([name, category, ms per step, calls per step])."""
    totals: dict[str, float] = {}
    kernels = []
    for name, (ms, calls) in per_kernel.items():
        category = kernel_category(name)
        totals[category] = totals.get(category, 0.0) + ms
        kernels.append([name[:160], category, round(ms, 3), calls])
    totals["total"] = sum(totals.values())
    kernels.sort(key=lambda k: -k[2])
    return {k: round(v, 3) for k, v in sorted(totals.items())}, kernels[:top]


def profile_step(step: Callable[[], Any], device: torch.device, steps: int = 3, top: int = 40
                 ) -> tuple[dict[str, float], list[list[Any]]]:
    """GPU kernel time per step by category (ms), from the PyTorch profiler over ``steps``, and
    the ``top`` kernels ([name, category, ms per step, calls per step])."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize(device)
    per_kernel = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us and event.device_type.name == "CUDA":
            per_kernel[event.key] = (us / 1e3 / steps, event.count / steps)
    return kernel_table(per_kernel, top)


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
                steps: int, warmup: int, device: torch.device, module_class: type,
                fp8_args: Optional[dict[str, Any]] = None, seed: int = 0,
                profile: bool = False, stepped: Callable[[], Any] = lambda: None
                ) -> dict[str, Any]:
    """Time ``steps`` training steps after ``warmup`` ones; returns the variant's figures.
    ``stepped`` is called after each warm-up and timed step (issued: on a GPU the host runs
    ahead), for a progress line.

    Raises whatever the step raises (``torch.OutOfMemoryError`` included): :func:`bench` records it.
    """
    torch.manual_seed(seed)
    start_mem = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        start_mem = torch.cuda.memory_allocated(device)
    step, plugin = build_step(variant, config, batch_size, seq_len, device=device,
                              module_class=module_class, fp8_args=fp8_args,
                              total_steps=warmup + steps + 8)
    for _ in range(warmup):
        step()
        stepped()
    timer = _Timer(device)
    timer.start()
    for _ in range(steps):
        loss = step()
        stepped()
    ms = timer.stop() / steps
    result: dict[str, Any] = {"loss": loss.item()}
    host, host_note = host_ms(step, device)
    result.update(host_ms=host, host_note=host_note)
    if profile and device.type == "cuda":
        result["profile_ms"], result["profile_kernels"] = profile_step(step, device)
        result["host_profile"] = host_profile(step)
    module = step.module  # type: ignore[attr-defined]
    compiled, graphs = module.compiled, module.graphed is not None
    result.update(compiled=compiled, cuda_graphs=graphs)
    if plugin is not None:
        result["precision"] = plugin.status
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
            steps: int, warmup: int, device: torch.device, module_class: type,
            fp8_args: Optional[dict[str, Any]] = None, seed: int = 0,
            profile: bool = False, stepped: Callable[[], Any] = lambda: None) -> dict[str, Any]:
    """:func:`run_variant` that never raises: out of memory is a skip, any other error a
    failure with its reason; the variant's memory is freed before returning."""
    try:
        result = run_variant(variant, config, batch_size, seq_len, steps=steps, warmup=warmup,
                             device=device, module_class=module_class, fp8_args=fp8_args,
                             seed=seed, profile=profile, stepped=stepped)
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
