"""``python -m fp8_lightning bench``: what FP8 buys on this GPU and this model, measured.

Each variant runs ``warmup + steps`` of ``fit``'s own training step, built through the training
code (:func:`~fp8_lightning.measure.build_step`: ``GPTLightningModule.loss`` with its compile setting, the module's AdamW
and schedule, gradient clipping, the ``FP8Precision`` plugin) on synthetic random tokens already
on the device: data loading and the Trainer's hooks are excluded. Timing uses CUDA events around
the ``steps`` timed steps (``perf_counter`` wall clock on a CPU, where MFU and peak memory are
n/a). ``host ms`` is the CPU time to issue one step while the GPU is kept busy (:func:`~fp8_lightning.measure.host_ms`):
a step whose host time is near its GPU time is host-bound.
FLOPs per token and MFU come from :mod:`fp8_lightning.flops`; speedups are against the baseline
(default: the first variant that ran, ``torch-compile`` in the default list).

Variants are ``<base>[-bf16ends][-te-attn][-fp8-attn][-fp8-head][-eager][-nograph][-fp32res|-bf16res]
[-ac-full|-ac-mlp][-autolayers|-alllayers][-recent|-hist1024]``:

* ``torch-eager`` / ``torch-compile``: the PyTorch backend in BF16 autocast, eager or under
  ``torch.compile`` (model + loss, one graph): the strong plain-PyTorch baseline.
* ``te-bf16``: the TransformerEngine backend in BF16 autocast.
* TE variants compile the regions between TE modules and replay the blocks as a CUDA graph, as
  ``fit`` does on one GPU; ``-eager`` turns compilation off, ``-nograph`` the graphs.
* ``fp8-<recipe>``: TE recipes (``delayed``, ``current``, ``block``, ``mxfp8``) on the TE
  backend, torchao recipes (``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``) on the PyTorch
  backend compiled whole and replayed as CUDA graphs (``-nograph``: without), through
  :class:`~fp8_lightning.fp8.FP8Precision` exactly as training runs it, with the config's layer
  policy (``fp8_lm_head``, ``bf16_first_layers``, ...) and, for the config's own recipe, its
  fields.
* ``-bf16ends``: the layer policy keeps the first and last block BF16 (FP8 variants only).
* ``-te-attn``: ``te.DotProductAttention`` instead of SDPA (TE variants only).
* ``-fp8-attn``: ``te.DotProductAttention`` with the recipe's ``fp8_dpa`` (attention in FP8;
  delayed and current only); ``-fp8-head``: the LM head in FP8 (``fp8_lm_head``).
* ``-recent`` / ``-hist1024``: delayed scaling from the last step's amax alone
  (``amax_compute_algo: most_recent``, ``amax_history_len: 1``, what ``configs/gpt2_fp8.yaml``
  ships) / from TE's default history, the maximum over 1,024 steps; without either, the
  config's.
* ``-fp32res`` / ``-bf16res``: the residual stream in float32 / in BF16 (``fp32_residual``;
  unset, each backend's default: float32 on the PyTorch backend, BF16 on TE).
* ``-ac-full`` / ``-ac-mlp``: activation checkpointing of every block / of every MLP
  (``model.activation_checkpointing``): the memory it saves and the time it costs.
* ``-autolayers`` / ``-alllayers``: ``fp8_layers: auto``, the GEMMs too small to gain stay BF16
  (TE: timed on this GPU at the bench's micro-batch; torchao: its own size filter) / ``all``;
  without either, the config's, else the recipe's default (``auto`` for ``tensorwise``) (FP8
  variants only).

All variants keep fp32 master weights (``bf16-mixed``), whatever the config's ``weights``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional, Union

import torch

from ..config import ConfigError
from ..flops import flops_per_token
from ..measure import DEFAULT_VARIANTS, environment, measure, method, parse_variant, skip_reason
from ..module import GPTLightningModule
from ..plots import MissingExtraError
from ..progress import Progress
from ..te_availability import cpu_has_native_bf16, te_status
from .run_config import check_fp8_plugin, fp8_plugin_args, load_run_config, positive_int_problems

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------- report
def _fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"  # None: not measurable here


def _fmt_tflops(value: float) -> str:
    # Two significant digits below 1: a CPU's few GFLOP/s are not "0.00".
    return f"{value:.2f}" if value >= 1 else f"{value:.2g}"


def format_table(report: dict[str, Any]) -> str:
    """The printed table: ran variants, then skipped/failed ones with their reasons."""
    s = report["setup"]
    w = max([26] + [len(r["variant"]) + 2 for r in report["results"]])  # the variant column
    lines = [f"bench: {s['model']} ({s['n_layer']} layers), batch {s['batch_size']} x seq "
             f"{s['seq_len']}, {s['warmup']} warm-up + {s['steps']} timed steps, on "
             f"{report['env']['device']}; speedup vs {report['baseline'] or '-'}",
             f"{'variant':<{w}}{'precision':<30}{'tok/s':>12}{'ms/step':>10}{'host ms':>9}"
             f"{'TFLOP/s':>9}{'MFU':>7}{'peak GiB':>9}{'speedup':>9}"]
    skipped = []
    for r in report["results"]:
        if r["status"] != "ran":
            skipped.append(f"  {r['variant']}: {r['status']}: {r['reason']}")
            continue
        lines.append(f"{r['variant']:<{w}}{r['precision'][:29]:<30}{r['tokens_per_s']:>12,.0f}"
                     f"{r['ms_per_step']:>10.2f}{_fmt(r.get('host_ms'), '.1f'):>9}"
                     f"{_fmt_tflops(r['tflops']):>9}"
                     f"{_fmt(None if r['mfu'] is None else 100 * r['mfu'], '.1f', '%'):>7}"
                     f"{_fmt(r['peak_mem_gib'], '.2f'):>9}{_fmt(r.get('speedup'), '.2f', 'x'):>9}")
    profiled = [r for r in report["results"] if r.get("profile_ms")]
    if profiled:
        categories = sorted({c for r in profiled for c in r["profile_ms"] if c != "total"})
        lines.append("GPU kernel ms per step (profiler), host ms per step:")
        lines.append(f"{'variant':<{w}}" + "".join(f"{c[:12]:>13}" for c in categories)
                     + f"{'total':>9}{'host':>8}")
        for r in profiled:
            p = r["profile_ms"]
            lines.append(f"{r['variant']:<{w}}" + "".join(f"{p.get(c, 0.0):>13.2f}" for c in categories)
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
    from ..plots import pyplot

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
          baseline: Optional[str] = None, output_dir: str = "runs/bench",
          seed: int = 0, profile: bool = False) -> dict[str, Any]:
    """Time training-step variants of a config's model and report tok/s, MFU, memory, speedup.

    Args:
        config: a ``fit`` YAML (``configs/*.yaml``): model, ``data.batch_size``, FP8 plugin args.
        variants: variants to run, in order (comma-separated or a list); default: all of
            torch-compile, torch-eager, te-bf16, fp8-delayed, fp8-current, fp8-block, fp8-mxfp8,
            te-bf16-te-attn, fp8-delayed-te-attn, fp8-delayed-bf16ends, fp8-tensorwise,
            fp8-rowwise (on a CPU without torch-compile, whose compilation takes minutes there).
            Those that cannot run here are listed as skipped with the reason.
        steps: timed training steps per variant.
        warmup: untimed steps first (compilation, FP8 scale calibration, cuBLAS autotuning).
        model: a preset replacing the config's ``model.config.name`` (e.g. ``gpt-1.3b``).
        batch_size: sequences per step (default: the config's ``data.batch_size``).
        seq_len: tokens per sequence (default: the model's ``block_size``).
        n_layer: cut the model to this many blocks (to fit big models on one GPU).
        baseline: the variant speedups are relative to (default: the first that ran).
        output_dir: where ``bench.json`` and ``bench.png`` go (under ``runs/``, which git
            ignores).
        seed: seed for the weights and the synthetic tokens.
        profile: also profile 3 steps of each variant on the GPU and print the kernel time per
            step by category (GEMM, attention, FP8 cast/transpose/amax, loss, optimizer, other).
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # On a CPU the default leaves torch-compile out: Inductor compiling the model's step takes
    # minutes on a small CPU, and fit trains eagerly there anyway (model.compile's default).
    names = variants or [n for n in DEFAULT_VARIANTS
                         if device.type == "cuda" or n != "torch-compile"]
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
    # library can bind a second cuDNN (libcudnn_cnn.so.9: undefined symbol).
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

    skipped = {v.name: skip_reason(v, batch_size, seq_len) for v in parsed}
    if device.type == "cpu":
        runs = [name for name, reason in skipped.items() if reason is None]
        log.info("bench on a CPU: FP8 cannot run here, so nothing timed here tells what FP8 buys "
                 "on a GPU (its variants are listed as not run); %d variant(s) to time (%s), each "
                 "%d warm-up + %d timed steps, with the time left printed every few seconds",
                 len(runs), ", ".join(runs) or "none", warmup, steps)
    results = []
    for variant in parsed:
        reason = skipped[variant.name]
        if reason is not None:
            results.append({"variant": variant.name, "status": "skipped", "reason": reason})
            log.info("bench %s: skipped (%s)", variant.name, reason)
            continue
        log.info("bench %s: %d warm-up + %d steps", variant.name, warmup, steps)
        fp8_args = fp8_plugin_args(run, variant) if variant.recipe else None
        issued = [0]  # steps the host has issued (the first one compiles, where compiled)

        def stepped() -> None:
            issued[0] += 1

        with Progress(f"bench {variant.name}, steps", warmup + steps, lambda: issued[0],
                      say=log.info):
            results.append(measure(variant, model_config, batch_size, seq_len, steps=steps,
                                   warmup=warmup, device=device, module_class=GPTLightningModule,
                                   fp8_args=fp8_args, seed=seed, profile=profile,
                                   stepped=stepped))
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
    drawn = False
    if ran:  # after the table: without matplotlib (the [plots] extra) it still shows
        try:
            plot(report, out / "bench.png")
            drawn = True
        except MissingExtraError as err:
            print(f"note: no plot: {err}")
    print(f"wrote {out / 'bench.json'}" + (f" and {out / 'bench.png'}" if drawn else ""))
    return report
