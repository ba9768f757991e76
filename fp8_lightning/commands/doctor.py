"""``python -m fp8_lightning doctor``: is FP8 active here, will it pay, and is the config sound?

It prints the environment (GPU, driver, CUDA, cuDNN, torch, TransformerEngine, attention
backends), FP8 availability per recipe with TransformerEngine's own reasons, a lint of the config
and an FP8 benefit probe. The probe times the model's own distinct GEMM shapes (forward +
backward, ``te.Linear``) in BF16 and in FP8 per recipe, then predicts the step speedup of FP8 over
the same model in BF16 on TE (``te-bf16`` in ``bench``), assuming the non-GEMM part of the step
(attention, norms, activations, loss, optimizer) takes the same time in both. That part is
measured: one short BF16 step of the model minus the probe's BF16 GEMM time.

Exit status: 0 fine; 1 the config requests FP8 (``FP8Precision`` in ``trainer.plugins``) but FP8
cannot run here; 2 the config has errors (the lint names each field).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..config import VOCAB_MULTIPLE, ConfigError, GPTConfig, check_micro_batch
from ..fp8 import DEFAULT_RECIPE, RECIPES, Gemm, bf16_module_names, build_recipe_config, \
    engine_backend, get_engine
from ..fp8.recipes import split_recipe
from ..measure import environment, free_memory, measure, parse_variant
from ..model import GPT
from ..module import GPTLightningModule
from ..te_availability import (MIN_FP8_CAPABILITY, TE_MIN_VERSION, fallback_precision, te_module,
                         te_status)
from .run_config import RunConfig, check_fp8_plugin, load_run_config, positive_int_problems

EXIT_OK, EXIT_FP8_UNUSABLE, EXIT_BAD_CONFIG = 0, 1, 2
FP8_NEEDS = (f"FP8 needs an NVIDIA GPU with compute capability >= {MIN_FP8_CAPABILITY[0]}."
             f"{MIN_FP8_CAPABILITY[1]} (Ada, Hopper, Blackwell) and TransformerEngine >= "
             f"{TE_MIN_VERSION}")


def _say(text: str = "") -> None:
    print(text, flush=True)


def _heading(title: str) -> None:
    _say(f"\n== {title} ==")


# --------------------------------------------------------------------------------- environment
def driver_version() -> str:
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return "unknown (nvidia-smi not available)"


def cudnn_text(version: int) -> str:
    """``92400`` -> ``9.24.0`` (cuDNN 9 encodes major*10000 + minor*100 + patch, 8 major*1000 +
    minor*100 + patch)."""
    major = version // 10000 if version >= 90000 else version // 1000
    minor = (version % 10000 if version >= 90000 else version % 1000) // 100
    return f"{major}.{minor}.{version % 100}"


def report_environment() -> dict[str, Any]:
    env = environment()
    try:
        env["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:  # noqa: BLE001 - a broken cuDNN is reported, not raised
        env["cudnn"] = None
    ok, env["transformer_engine_status"] = te_status()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpus=torch.cuda.device_count(), gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   driver=driver_version())
        if ok:
            env["te_cudnn_runtime"] = ".".join(map(str, te_module().get_cudnn_version()))
    _heading("Environment")
    # torch.version.cuda and cuDNN's version are what torch was built with and ships, not a GPU.
    gpu = "" if torch.cuda.is_available() else "; no CUDA GPU visible"
    shown = dict(env, cuda=(f"torch built with CUDA {env['cuda']}" if env["cuda"]
                            else "torch built without CUDA") + gpu)
    if env["cudnn"]:
        shown["cudnn"] = f"torch's cuDNN {cudnn_text(env['cudnn'])}{gpu}"
    for key in ("device", "compute_capability", "gpus", "gpu_memory_gib", "driver", "cuda",
                "cudnn", "te_cudnn_runtime", "torch", "transformer_engine",
                "transformer_engine_status", "python", "git_commit"):
        if key in shown:
            _say(f"  {key}: {shown[key]}")
    if not torch.cuda.is_available():
        _say(f"  no CUDA GPU is visible: the PyTorch backend trains in {fallback_precision()[1]}. {FP8_NEEDS}.")
    return env


def sdpa_backends(n_head: int, head_dim: int) -> dict[str, str]:
    """Which ``F.scaled_dot_product_attention`` kernels run a causal BF16 forward of this head
    shape (tried one at a time; the reason is torch's warning when one cannot)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, n_head, 256, head_dim, device="cuda", dtype=torch.bfloat16)
    out = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("mem-efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q, q, q, is_causal=True)
                out[name] = "available"
            except RuntimeError as err:
                why = [str(w.message).splitlines()[0] for w in caught] or [str(err).splitlines()[0]]
                out[name] = "not available: " + "; ".join(why)[:300]
    return out


def te_attention_backends(config: GPTConfig, batch_size: int, seq_len: int) -> dict[str, str]:
    """TransformerEngine's own choice for this model's attention (``get_attention_backend``)."""
    from transformer_engine.pytorch.attention.dot_product_attention import utils as dpa_utils

    fa = dpa_utils.FlashAttentionUtils
    out = {"flash-attn package": str(fa.version) if fa.is_installed else "not installed",
           "flash-attn 3": str(fa.fa3_version) if fa.v3_is_installed else "not installed"}
    params = dpa_utils.AttentionParams(
        qkv_dtype=torch.bfloat16, qkv_layout="bshd_bshd_bshd", batch_size=batch_size,
        num_heads=config.n_head, num_gqa_groups=config.n_kv_heads, max_seqlen_q=seq_len,
        max_seqlen_kv=seq_len, head_dim_qk=config.head_dim, head_dim_v=config.head_dim,
        attn_mask_type="causal")
    available = dpa_utils.get_attention_backend(params)[-1]  # [flash, fused (cuDNN), unfused]
    for name, ok in zip(("FlashAttention", "FusedAttention (cuDNN)", "UnfusedDotProductAttention"),
                        available):
        out[name] = "available" if ok else "not available for this shape"
    return out


def report_attention(config: GPTConfig, batch_size: int, seq_len: int) -> dict[str, Any]:
    _heading(f"Attention backends (head dim {config.head_dim}, {config.n_head} heads, "
             f"seq {seq_len}, BF16, causal)")
    out: dict[str, Any] = {}
    if not torch.cuda.is_available():
        _say("  SDPA runs its CPU kernels here (no CUDA); te.DotProductAttention needs a GPU")
        return out
    out["sdpa"] = sdpa_backends(config.n_head, config.head_dim)
    for name, status in out["sdpa"].items():
        _say(f"  SDPA {name}: {status}")
    if te_status()[0]:
        try:
            out["te"] = te_attention_backends(config, batch_size, seq_len)
        except Exception as err:  # noqa: BLE001 - an internal TE API; report, don't fail
            out["te"] = {"error": f"could not query TE's attention backends: "
                                  f"{type(err).__name__}: {err}"}
        for name, status in out["te"].items():
            _say(f"  te.DotProductAttention {name}: {status}")
    else:
        _say(f"  te.DotProductAttention: {te_status()[1]}")
    return out


def report_recipes() -> dict[str, tuple[bool, str]]:
    _heading("FP8 per recipe (each engine's own answer)")
    out = {}
    for recipe, entry in RECIPES.items():
        ok, reason = get_engine(entry.engine).available(recipe)
        out[recipe] = (ok, reason)
        _say(f"  {recipe:<18} {entry.engine:<8} "
             f"{'available on ' + reason if ok else 'NOT available: ' + reason}")
    return out


# --------------------------------------------------------------------------------- lint
@dataclass
class Lint:
    """What the config lint found; ``config`` is ``None`` when the model config is invalid."""

    config: Optional[GPTConfig]
    batch_size: int
    seq_len: int
    problems: list[str]
    notes: list[str]


def lint(run: RunConfig, batch_size: Optional[int] = None, seq_len: Optional[int] = None,
         n_layer: Optional[int] = None) -> Lint:
    """Check the model dims, micro-batch, vocabulary padding and FP8 plugin fields."""
    problems, notes = [], []
    config = None
    try:
        config = run.gpt_config(n_layer=n_layer, seq_len=seq_len)
    except ConfigError as err:
        problems += [f"model.config: {p}" for p in err.problems]
    batch_size = run.batch_size if batch_size is None else batch_size
    problems += positive_int_problems(**{"data.batch_size": batch_size})
    if seq_len is not None:
        problems += positive_int_problems(seq_len=seq_len)
    if run.backend not in ("auto", "te", "torch"):
        problems.append(f"model.backend={run.backend!r}; valid: auto, te, torch")
    if run.attention not in ("sdpa", "te"):
        problems.append(f"model.attention={run.attention!r}; valid: sdpa, te")
    elif run.attention == "te" and run.backend == "torch":
        problems.append("model.attention='te' (te.DotProductAttention) needs model.backend: te or auto")
    seq = seq_len if seq_len is not None else (config.block_size if config else 0)
    if config is not None and not problems:
        notes.append(f"model {config.name}: {config.n_layer} layers, n_embd {config.n_embd}, "
                     f"ffn {config.ffn_hidden}, heads {config.n_head}/{config.n_kv_heads} "
                     f"(head dim {config.head_dim}); every GEMM dim is a multiple of 16")
        if config.padded_vocab_size != config.vocab_size:
            notes.append(f"vocab {config.vocab_size} is padded to {config.padded_vocab_size} "
                         f"(multiple of {VOCAB_MULTIPLE}) for the embedding and LM head")
        notes.append(f"micro-batch: {batch_size} x {seq} = {batch_size * seq} tokens = the M "
                     f"dim of every GEMM")
        try:
            check_micro_batch(batch_size, seq)
        except ConfigError as err:
            problems += err.problems  # the data module refuses it for every run, FP8 or not
    plugin, plugin_problems = check_fp8_plugin(run.fp8)
    problems += plugin_problems
    if plugin is not None:
        cfg = plugin.recipe_config
        notes.append("FP8 recipe: " + ", ".join(f"{k}={v}" for k, v in cfg.items()))
        if plugin.fp8_lm_head:
            notes.append("WARNING fp8_lm_head=true: the LM head's logits feed the loss "
                         "directly and FP8 there is the usual source of loss gaps; the "
                         "default keeps it BF16")
        if config is not None and plugin.bf16_first_layers + plugin.bf16_last_layers >= config.n_layer:
            notes.append(f"WARNING bf16_first_layers + bf16_last_layers >= n_layer="
                         f"{config.n_layer}: no block runs FP8")
    return Lint(config, batch_size, seq, problems, notes)


def report_lint(run: RunConfig, result: Lint) -> None:
    _heading(f"Config lint: {run.path}")
    for note in result.notes:
        _say(f"  {note}")
    for problem in result.problems:
        _say(f"  ERROR {problem}")
    if not result.problems:
        _say("  no errors")


def model_gemms(config: GPTConfig, fp8_lm_head: bool = False, bf16_first_layers: int = 0,
                bf16_last_layers: int = 0) -> list[Gemm]:
    """The model's distinct GEMM shapes with counts (from a meta-device model: no memory)."""
    with torch.device("meta"):
        model = GPT(config, backend="torch")
    keep = bf16_module_names(model, get_engine("torchao").gemm_modules(model),
                             fp8_lm_head=fp8_lm_head, bf16_first_layers=bf16_first_layers,
                             bf16_last_layers=bf16_last_layers)
    gemms: dict[tuple, Gemm] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            continue
        in_bf16 = any(name == k or name.startswith(k + ".") for k in keep)
        for pname, weight in module.named_parameters(recurse=False):
            if weight.ndim != 2:
                continue
            label = re.sub(r"^blocks\.\d+\.", "", name)
            if pname != "weight":  # LayerNormMLP's fc1_weight / fc2_weight
                label += "." + pname.removesuffix("_weight")
            bias = getattr(module, pname.replace("weight", "bias"), None) is not None
            gemm = gemms.setdefault((label, weight.shape[1], weight.shape[0], bias),
                                    Gemm(label, weight.shape[1], weight.shape[0], bias))
            if in_bf16:
                gemm.bf16 += 1
            else:
                gemm.fp8 += 1
    return list(gemms.values())


def predict(gemms: list[Gemm], times: dict[str, list[Optional[float]]], step_ms: Optional[float]
            ) -> dict[str, Any]:
    """Predicted FP8 step speedups from per-shape timings (ms, ``None`` where a shape failed).

    ``times["bf16"][i]`` and ``times[recipe][i]`` time one forward + backward of ``gemms[i]``.
    The non-GEMM time (``step_ms`` minus the BF16 GEMMs) is assumed unchanged by FP8; without a
    measured ``step_ms`` the GEMM-time speedup is returned (an upper bound on the step speedup).
    Also lists, per recipe, the GEMMs that are slower in FP8 and the speedup with them in BF16.
    """
    def step_with(recipe: str, bf16_labels: frozenset = frozenset()) -> float:
        total = other
        for i, g in enumerate(gemms):
            fp8 = 0 if g.label in bf16_labels else g.fp8
            total += fp8 * times[recipe][i] + (g.fp8 + g.bf16 - fp8) * times["bf16"][i]
        return total

    gemm_bf16 = sum((g.fp8 + g.bf16) * times["bf16"][i] for i, g in enumerate(gemms))
    base = gemm_bf16 if step_ms is None else step_ms
    other = max(base - gemm_bf16, 0.0)
    out: dict[str, Any] = {"gemm_bf16_ms": gemm_bf16, "step_bf16_ms": step_ms, "other_ms": other,
                           "speedup": {}, "fp8_slower": {}, "speedup_slower_in_bf16": {}}
    for recipe in (r for r in times if r != "bf16"):
        if any(t is None for t in times[recipe]):
            continue
        out["speedup"][recipe] = base / step_with(recipe)
        slower = sorted({g.label for i, g in enumerate(gemms)
                         if g.fp8 and times[recipe][i] >= times["bf16"][i]})
        if slower:
            out["fp8_slower"][recipe] = slower
            out["speedup_slower_in_bf16"][recipe] = base / step_with(recipe, frozenset(slower))
    return out


def benefit_probe(run: RunConfig, result: Lint, recipes: list[str], *, reps: int = 10,
                  step_steps: int = 5) -> dict[str, Any]:
    """Time the model's GEMM shapes per recipe and predict the FP8 step speedup over te-bf16."""
    config, batch_size, seq_len = result.config, result.batch_size, result.seq_len
    tokens = batch_size * seq_len
    fp8 = run.fp8 or {}
    gemms = model_gemms(config, fp8_lm_head=fp8.get("fp8_lm_head", False),
                        bf16_first_layers=fp8.get("bf16_first_layers", 0),
                        bf16_last_layers=fp8.get("bf16_last_layers", 0))
    _heading(f"FP8 benefit probe: {len(gemms)} GEMM shapes at M = {batch_size} x {seq_len} = "
             f"{tokens} tokens, forward + backward (te.Linear, GPU kernel time, {reps} reps)")
    te = get_engine("te")
    te_recipes: dict[str, Any] = {"bf16": None}  # name -> recipe config (None: BF16)
    name, fields = split_recipe(fp8.get("recipe"))
    for r in recipes:  # the config's own recipe fields for its recipe, defaults for the others
        te_recipes[r] = build_recipe_config(
            r, **(fields if (name or DEFAULT_RECIPE["te"]) == r else {}))
    times: dict[str, list[Optional[float]]] = {name: [] for name in te_recipes}
    errors: dict[str, str] = {}
    for g in gemms:
        for name, recipe in te_recipes.items():
            try:
                times[name].append(te.time_gemm(g, tokens, recipe, reps=reps))
            except Exception as err:  # noqa: BLE001 - a shape a recipe cannot take is a finding
                times[name].append(None)
                errors.setdefault(name, f"{g.label}: {type(err).__name__}: "
                                        f"{(str(err).strip().splitlines() or [''])[0][:200]}")
            free_memory(torch.device("cuda"))
    if errors.get("bf16"):
        _say(f"  the BF16 GEMM probe failed ({errors['bf16']}); no prediction")
        return {"tokens": tokens, "errors": errors}
    ms = lambda t: "failed" if t is None else f"{t:.3f}"  # noqa: E731
    _say(f"  {'GEMM':<26}{'count':>7}{'BF16 ms':>10}" + "".join(f"{r + ' ms':>20}" for r in recipes))
    for i, g in enumerate(gemms):
        count = f"{g.fp8}+{g.bf16}b" if g.bf16 else str(g.fp8)
        row = f"  {g.label + f' {g.n_in}->{g.n_out}':<26}{count:>7}{ms(times['bf16'][i]):>10}"
        for r in recipes:
            t = times[r][i]
            row += f"{ms(t):>12}" + ("" if t is None else f" ({times['bf16'][i] / t:.2f}x)").rjust(8)
        _say(row)
    _say("  count: GEMMs of that shape per step that run FP8 (+b: kept BF16 by the layer policy)")
    for r, why in errors.items():
        _say(f"  {r}: failed for {why}")

    # The non-GEMM time: a short BF16 step of the model itself, minus the BF16 GEMMs.
    variant = parse_variant("te-bf16" + ("-te-attn" if run.attention == "te" else ""))
    step = measure(variant, config, batch_size, seq_len, steps=step_steps, warmup=2,
                   device=torch.device("cuda"), module_class=GPTLightningModule)
    pred = predict(gemms, times, step["ms_per_step"] if step["status"] == "ran" else None)
    if step["status"] == "ran":
        _say(f"  measured BF16 step of this model on TE: {pred['step_bf16_ms']:.2f} ms; its GEMMs "
             f"(probe): {pred['gemm_bf16_ms']:.2f} ms; the rest, {pred['other_ms']:.2f} ms, is "
             f"assumed unchanged by FP8")
        if pred["gemm_bf16_ms"] > pred["step_bf16_ms"]:
            _say("  note: the isolated GEMMs' kernels took longer than the whole step (fusion in "
                 "the real modules): the prediction is rough")
    else:
        _say(f"  could not time a BF16 step ({step['status']}: {step['reason']}): predicting the "
             f"GEMM-time speedup only (an upper bound on the step speedup)")
    _say("  predicted step speedup of FP8 over te-bf16 (the same model in BF16 on TE):")
    for r, speedup in pred["speedup"].items():
        line = f"    {r:<8} {speedup:.2f}x"
        if r in pred["fp8_slower"]:
            line += (f"   FP8 slower than BF16 for: {', '.join(pred['fp8_slower'][r])}; with those "
                     f"in BF16: {pred['speedup_slower_in_bf16'][r]:.2f}x")
        _say(line)
        if speedup < 1.0:
            _say(f"  WARNING FP8 {r} is predicted SLOWER than BF16 ({speedup:.2f}x) for this model "
                 f"at {tokens} tokens per micro-batch: its GEMMs are too small for FP8's "
                 f"quantisation overhead to pay")
    suggestions = suggest(pred, fp8)
    for line in suggestions:
        _say(f"  suggestion: {line}")
    _say("  assumptions: GPU-bound steps (kernel time, not TE's per-call CPU time); non-GEMM time "
         "unchanged by FP8; each probed GEMM quantises its own input (the real "
         "LayerNormLinear/LayerNormMLP fuse that into the norm), so the prediction errs low; "
         "`bench` measures the truth")
    return {"tokens": tokens, "gemms": [asdict(g) for g in gemms], "times_ms": times,
            "errors": errors, "step": step, **pred, "suggestions": suggestions}


def suggest(pred: dict[str, Any], fp8: dict[str, Any]) -> list[str]:
    """Layer-policy and recipe suggestions from :func:`predict`'s output."""
    slower = set().union(*pred["fp8_slower"].values())
    speedups = pred["speedup"]
    suggestions = []
    if "lm_head" in slower and fp8.get("fp8_lm_head"):
        suggestions.append("keep the LM head in BF16: fp8_lm_head: false")
    block = sorted(slower - {"lm_head"})
    if block:
        suggestions.append(
            f"keep the small projections ({', '.join(block)}) in BF16; the layer policy keeps "
            f"whole blocks in BF16 (bf16_first_layers / bf16_last_layers), and every block has "
            f"these shapes, so a per-projection choice is not available yet")
    if speedups and max(speedups.values()) < 1.0:
        suggestions.append("FP8 does not pay for this model and micro-batch: train it in BF16 "
                           "(compare `bench` torch-compile), or give FP8 larger GEMMs (more "
                           "tokens per micro-batch, a wider model)")
    elif speedups:
        best = max(speedups, key=speedups.get)
        suggestions.append(f"fastest predicted recipe here: {best} ({speedups[best]:.2f}x); "
                           f"measure it with `python -m fp8_lightning bench`")
    return suggestions


# --------------------------------------------------------------------------------- command
def doctor(config: Optional[str] = None, probe: bool = True, model: Optional[str] = None,
           batch_size: Optional[int] = None, seq_len: Optional[int] = None,
           n_layer: Optional[int] = None, reps: int = 10, output: Optional[str] = None) -> int:
    """Check the environment, FP8 per recipe, a config, and whether FP8 will pay; returns the
    exit status (0 fine, 1 FP8 requested but unusable here, 2 config errors).

    Args:
        config: a ``fit`` YAML to lint and probe (``configs/*.yaml``); without it only the
            environment and FP8 availability are reported.
        probe: time the model's GEMM shapes in BF16 and FP8 (needs an FP8 GPU with TE).
        model: a preset replacing the config's ``model.config.name`` (e.g. ``gpt-1.3b``).
        batch_size: micro-batch for the lint and the probe (default: ``data.batch_size``).
        seq_len: sequence length (default: the model's ``block_size``).
        n_layer: cut the model to this many blocks (as ``bench --n_layer``) for the lint and the
            probe.
        reps: timed repetitions per GEMM shape and recipe.
        output: also write the findings to this JSON file.
    """
    problems = positive_int_problems(reps=reps)
    if problems:
        raise ConfigError(problems, "doctor")
    run = load_run_config(config, model) if config else None
    # Import TE before anything loads torch's cuDNN (the environment report, the SDPA probe):
    # imported afterwards, TE can fail with "libcudnn_heuristic.so.9: undefined symbol" and FP8
    # would read as unavailable (as in bench).
    te_status()
    report: dict[str, Any] = {"env": report_environment()}
    result = lint(run, batch_size, seq_len, n_layer) if run else None
    shape = result if result is not None and result.config is not None else None
    attn_config = shape.config if shape else GPTConfig()  # gpt2's head shape without a config
    report["attention"] = report_attention(attn_config, shape.batch_size if shape else 8,
                                           shape.seq_len if shape else attn_config.block_size)
    recipes = report_recipes()
    report["recipes"] = {r: {"available": ok, "reason": why} for r, (ok, why) in recipes.items()}
    code, verdict = EXIT_OK, []
    if run is not None:
        report_lint(run, result)
        report["lint"] = {"problems": result.problems, "notes": result.notes}
        if result.problems:
            code = EXIT_BAD_CONFIG
            verdict.append(f"the config has {len(result.problems)} error(s) (see the lint)")
    if run is not None and code == EXIT_OK:
        requested = None
        if run.fp8 is not None:  # FP8Precision's default recipe: its engine's
            requested = split_recipe(run.fp8.get("recipe"))[0] or DEFAULT_RECIPE[
                "torchao" if run.fp8.get("engine") == "torchao" else "te"]
        available = [r for r, (ok, _) in recipes.items() if ok]
        if requested is None:
            verdict.append("the config trains BF16 (no FP8Precision in trainer.plugins)")
            if not available:
                verdict.append(f"{FP8_NEEDS}, which this machine lacks ({recipes['delayed'][1]}); "
                               f"this config does not need it")
        else:
            ok, why = recipes[requested]
            if not ok:
                why = f"{why}. {FP8_NEEDS}"
            elif RECIPES[requested].engine == "te" and run.backend == "torch":
                ok, why = False, "model.backend is torch (no TransformerEngine layers); use auto or te"
            elif RECIPES[requested].engine == "torchao" and run.backend != engine_backend("torchao"):
                ok, why = False, (f"recipe {requested} runs on torchao, in the PyTorch layers; "
                                  f"model.backend is {run.backend}: use torch")
            if ok:
                verdict.append(f"FP8 {requested} is requested and can run here ({why})")
            else:
                code = EXIT_FP8_UNUSABLE
                verdict.append(f"FP8 {requested} is requested but CANNOT run here: {why}. " + (
                    "The run would stop (on_unavailable=error)." if run.fp8.get("on_unavailable") == "error"
                    else f"The run would fall back to {fallback_precision()[1]} "
                         "(on_unavailable=fallback)."))
        if probe and available:
            report["probe"] = benefit_probe(  # times te.Linear: TE's recipes only
                run, result, [r for r in available if RECIPES[r].engine == "te"], reps=reps)
        elif probe:
            _heading("FP8 benefit probe")
            _say(f"  skipped: no FP8 recipe can run here ({FP8_NEEDS})")
    elif run is None:
        verdict.append("give --config to lint a run config and probe its FP8 benefit")
    _heading("Verdict")
    for line in verdict:
        _say(f"  {line}")
    _say(f"  exit status {code}")
    report.update(verdict=verdict, exit_status=code)
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return code
