"""FP8 on a model this package did not build: ``FP8Precision`` around a user's ``LightningModule``
(``examples/own_model.py``'s plain ``torch.nn`` GPT, or a Hugging Face ``LlamaForCausalLM``),
against the same module's BF16 (``bf16-mixed``), compiled and eager. Each variant runs in its own
process on one GPU (with several ``--gpus``, as many at a time, one per GPU).

Usage:
    python benchmarks/own_model.py --model nanogpt-1.3b --gpus 0 1
    python benchmarks/own_model.py --model llama-1b --variants bf16 tensorwise delayed

``--accumulate N``: an optimizer step every N micro-batches (Lightning's ``accumulate_grad_batches``),
as a run with a larger global batch takes them; steps and windows count optimizer steps.

Prints one JSON line per variant (tok/s: the median of 10-step windows after the warm-up, the
precision that ran, peak memory), then a table with each variant over the faster BF16 and, from
``StepProfile`` over the optimizer steps of 5 micro-batches after the timed ones, each step's
GPU compute and GPU idle (host-bound) milliseconds: what to optimise.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

# name -> (kind, dims, micro-batch); nanoGPT dims as examples/own_model.py's NanoGPT takes them,
# Llama's as transformers' LlamaConfig (Llama 3.2 1B's shape)
MODELS = {
    "nanogpt-124m": ("nanogpt", dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12,
                                     n_embd=768), 16),
    "nanogpt-1.3b": ("nanogpt", dict(vocab_size=50304, block_size=1024, n_layer=24, n_head=16,
                                     n_embd=2048), 8),
    "llama-1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                               num_hidden_layers=16, num_attention_heads=32,
                               num_key_value_heads=8, max_position_embeddings=1024,
                               tie_word_embeddings=True, rope_theta=500000.0), 8),
}
# name -> (FP8Precision recipe or None for bf16-mixed, compiled, FP8Precision's and its Speedups
# converter's other settings);
# -head: the LM head in FP8 too (BF16 by the default policy), -all: every GEMM, torchao's size
# filter off; TE's blocks replay as CUDA graphs by default, -nograph: not; on Hopper the plugin
# tries cuDNN's attention first, -torch-order: PyTorch's own SDPA order; TE's GEMMs sum the
# weight gradients in FP32 by default (fuse_wgrad_accumulation), -bf16wgrad: TE's BF16 ones;
# TE fuses LayerNorm -> Linear -> GELU -> Linear into one te.LayerNormMLP by default, -unfusedmlp:
# not (fuse_mlp); TE's block graphs are captured from their torch.compile'd forward by default,
# -eagerblocks: from their own forward (compile_blocks)
VARIANTS = {"bf16": (None, True, {}), "bf16-eager": (None, False, {}),
            "tensorwise": ("tensorwise", True, {}),
            "tensorwise-head": ("tensorwise", True, {"fp8_lm_head": True}),
            "tensorwise-all": ("tensorwise", True, {"fp8_layers": "all"}),
            "delayed": ("delayed", False, {}),
            "delayed-nograph": ("delayed", False, {"cuda_graphs": False}),
            "delayed-torch-order": ("delayed", False, {"cudnn_attention": False}),
            "delayed-bf16wgrad": ("delayed", False, {"fuse_wgrad_accumulation": False}),
            "delayed-unfusedmlp": ("delayed", False, {"fuse_mlp": False}),
            "delayed-eagerblocks": ("delayed", False, {"compile_blocks": False}),
            "delayed-unfusedmlp-eagerblocks": ("delayed", False, {"fuse_mlp": False,
                                                                  "compile_blocks": False}),
            "current": ("current", False, {}), "delayed-compiled": ("delayed", True, {})}
SEQ = 1024
PROFILED = 5  # micro-batches profiled after the timed steps (whole optimizer steps, at least one)


def lit_module(name: str, compile: bool):
    import lightning as L
    import torch
    import torch.nn.functional as F

    kind, dims, _ = MODELS[name]
    if kind == "nanogpt":
        from examples.own_model import LitNanoGPT

        return LitNanoGPT(**dims, lr=3e-4, compile=compile)

    import transformers

    class LitLlama(L.LightningModule):  # what a user writes around a Hugging Face model
        def __init__(self) -> None:
            super().__init__()
            config = transformers.LlamaConfig(**dims, attn_implementation="sdpa")
            self.model = transformers.LlamaForCausalLM(config)

        def on_fit_start(self) -> None:
            if compile:
                self.model.compile()

        def training_step(self, batch, batch_idx):
            # no key/value cache in training (its cache object would keep the blocks from
            # replaying as CUDA graphs)
            logits = self.model(batch[:, :-1], use_cache=False).logits
            return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

    return LitLlama()


def run_variant(model: str, variant: str, steps: int, warmup: int, accumulate: int = 1) -> dict:
    import lightning as L
    import torch

    from fp8_lightning import Speedups
    from fp8_lightning.callbacks.profile import StepProfile
    from fp8_lightning.fp8 import FP8Precision

    recipe, compile, settings = VARIANTS[variant]
    _, dims, batch = MODELS[model]
    tokens = batch * SEQ * accumulate  # per optimizer step
    times: list[float] = []

    class Clock(L.Callback):  # a synchronised time stamp every 10 steps after the warm-up
        seen: set[int] = set()  # global_step repeats over an accumulation's micro-batches

        def on_train_batch_end(self, trainer, *args) -> None:
            step = trainer.global_step
            if step >= warmup and (step - warmup) % 10 == 0 and step not in self.seen:
                self.seen.add(step)
                torch.cuda.synchronize()
                times.append(time.perf_counter())

    L.seed_everything(0)
    module = lit_module(model, compile)
    vocab = dims["vocab_size"]
    profiled = -(-PROFILED // accumulate)  # the profiler's trace grows with each micro-batch
    data = torch.randint(0, vocab, ((steps + profiled + 1) * accumulate * batch, SEQ + 1))
    plugin = None
    if recipe:  # every FP8 variant with the Speedups converter, its options from the variant
        speedups = {k: v for k, v in settings.items() if k in inspect.signature(Speedups).parameters}
        plugin = FP8Precision(recipe=recipe, on_unavailable="error", converter=Speedups(**speedups),
                              **{k: v for k, v in settings.items() if k not in speedups})
    # profiled after the timed steps: the profiler's own cost stays out of tok/s
    profile = StepProfile(start_step=steps, steps=profiled, top=80)
    trainer = L.Trainer(max_steps=steps + profiled + 1, accelerator="gpu", devices=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=1.0,
                        accumulate_grad_batches=accumulate,
                        callbacks=[Clock(), profile], **({"plugins": [plugin]} if plugin else
                                                         {"precision": "bf16-mixed"}))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=batch, pin_memory=True))
    split = (profile.result or [{}])[0]
    rates = [10 * tokens / (b - a) for a, b in zip(times, times[1:])]
    graphs = plugin.converter.graphs if plugin is not None else None
    return {"model": model, "variant": variant, "accumulate": accumulate,
            "tok_s": round(statistics.median(rates)),
            "graphs": "-" if graphs is None else
            graphs.status + (", compiled" if graphs.compiled else ""),
            "windows": len(rates), "precision": plugin.status if plugin else "BF16",
            "fp8_modules_ran": len(plugin.engine.modules_ran(plugin.model)) if plugin else 0,
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
            **{k: round(split[k], 2) for k in ("step_ms", "compute_ms", "gpu_idle_ms")
               if split.get(k) is not None},
            "gpu": torch.cuda.get_device_name(), "kernels": profile.kernels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="nanogpt-1.3b")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS),
                        default=["bf16", "bf16-eager", "tensorwise", "delayed",
                                 "delayed-nograph"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of the figure")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="micro-batches per optimizer step (accumulate_grad_batches)")
    parser.add_argument("--gpus", nargs="+", default=["0"], help="run variants one per GPU")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # a child process: one variant
    args = parser.parse_args()
    if args.steps < args.warmup + 20:
        parser.error("--steps must be at least --warmup + 20 (two timed windows of 10 steps)")
    if args.accumulate < 1:
        parser.error("--accumulate must be at least 1")
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args.model, args.variant, args.steps,
                                                 args.warmup, args.accumulate)), flush=True)
        return
    results, pending = [], list(args.variants)
    while pending:  # as many at a time as GPUs, each child on its own
        batch, pending = pending[: len(args.gpus)], pending[len(args.gpus):]
        children = [subprocess.Popen(
            [sys.executable, __file__, "--model", args.model, "--variant", v, "--steps",
             str(args.steps), "--warmup", str(args.warmup), "--accumulate", str(args.accumulate)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu})
            for v, gpu in zip(batch, args.gpus)]
        for v, child in zip(batch, children):
            out = child.communicate()[0]
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            if child.returncode or not lines:
                print(f"{v}: exit {child.returncode}\n" + "\n".join(out.splitlines()[-15:]))
                continue
            results.append(json.loads(lines[-1][7:]))
            print(json.dumps(results[-1]), flush=True)
    bf16 = max((r["tok_s"] for r in results if r["variant"].startswith("bf16")), default=None)
    print(f"\n| {args.model} | tok/s | over the faster BF16 | precision | FP8 GEMM modules | "
          "block graphs | step ms (profiled) | GPU compute ms | GPU idle ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ratio = f"{r['tok_s'] / bf16:.2f}x" if bf16 else "-"
        print(f"| {r['variant']} | {r['tok_s']:,} | {ratio} | {r['precision']} | "
              f"{r['fp8_modules_ran']} | {r['graphs']} | {r.get('step_ms', '-')} | "
              f"{r.get('compute_ms', '-')} | {r.get('gpu_idle_ms', '-')} |")
    # where each variant's GPU time goes (StepProfile.kernels), ms a step
    cats = sorted({c for r in results for c in (r.get("kernels") or {}).get("categories", {})})
    if cats:
        print(f"\nGPU kernel ms a step by category\n{'variant':<18}"
              + "".join(f"{c[:12]:>13}" for c in cats))
        for r in results:
            got = (r.get("kernels") or {}).get("categories", {})
            print(f"{r['variant']:<18}" + "".join(f"{got.get(c, 0.0):>13.2f}" for c in cats))


if __name__ == "__main__":
    main()
