"""The plain PyTorch baseline: this package's PyTorch-backend GPT trained the way a hand-written
script would, with no Lightning: ``torch.compile``, BF16 autocast, fused AdamW, gradient-norm
clip 1.0, random tokens already on the GPU (no data loading), and on several GPUs
``DistributedDataParallel`` or FSDP2 the way torchtitan shards (each block compiled, then
``fully_shard`` per block; BF16 gathers, fp32 reduction).
Every BF16 column of docs/benchmarks.md is the faster of this script and the package's own
compiled BF16 run.

Usage (one GPU, then two):
    python benchmarks/plain_pytorch.py --model gpt2 --batch_size 16
    torchrun --nproc_per_node 2 benchmarks/plain_pytorch.py --model gpt2 --batch_size 16 --strategy ddp

Prints one JSON line (rank 0): tok/s per GPU as the median of 10-step windows after the
warm-up, the step time, MFU and peak memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from fp8_lightning.config import GPTConfig  # noqa: E402
from fp8_lightning.flops import flops_per_token, mfu, peak_for  # noqa: E402
from fp8_lightning.model import GPT, compile_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", help="a preset of fp8_lightning.config")
    parser.add_argument("--batch_size", type=int, default=16, help="sequences per GPU")
    parser.add_argument("--seq_len", type=int, default=None, help="default: the block size")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of the figure")
    parser.add_argument("--n_layer", type=int, default=None, help="cut the model (default: "
                        "the preset's depth)")
    parser.add_argument("--activation_checkpointing", choices=("none", "full", "mlp"),
                        default="none", help="as the package's model.activation_checkpointing "
                        "(the Llama-3-8B configs' mlp: what fits 80 GB)")
    parser.add_argument("--strategy", choices=("ddp", "ddp-bf16grad", "fsdp", "fsdp-keep",
                                               "fsdp-whole"),
                        default="ddp", help="with several processes (torchrun); ddp-bf16grad: "
                        "gradients all-reduced in BF16; fsdp: FSDP2 as torchtitan shards "
                        "(blocks compiled, then sharded); fsdp-keep: blocks not resharded after "
                        "forward; fsdp-whole: the model compiled whole around the sharded blocks")
    args = parser.parse_args()
    if args.n_layer is not None and args.n_layer < 1:
        parser.error(f"--n_layer {args.n_layer}: a whole number >= 1 (default: the preset's)")
    if args.batch_size < 1 or args.warmup < 0 or args.steps < args.warmup + 20:
        parser.error("--batch_size >= 1, --warmup >= 0 and --steps >= warmup + 20 (two timed "
                     "windows of 10 steps)")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    if world > 1:
        dist.init_process_group("nccl", device_id=device)
    torch.manual_seed(1337 + local)
    config = GPTConfig.from_name(args.model)
    if args.n_layer is not None:
        config = dataclasses.replace(config, n_layer=args.n_layer)
    T = args.seq_len or config.block_size
    with device:
        model = GPT(config, backend="torch", activation_checkpointing=args.activation_checkpointing)
    if world > 1 and args.strategy.startswith("fsdp"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # torchtitan's layout: each block (and the loss) compiled on its own, then each block
        # sharded, so FSDP2's gather/reduce hooks stay outside the compiled graphs; the last
        # block and the root (embeddings, final norm, LM head) stay gathered after forward,
        # since backward needs them first. fsdp-whole: the model compiled whole around the
        # sharded blocks (Dynamo breaks its graph at every FSDP2 hook).
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if args.strategy != "fsdp-whole":
            compile_model(model, per_block=True)
        blocks = list(model.blocks)
        for i, block in enumerate(blocks):
            fully_shard(block, mp_policy=policy, reshard_after_forward=(
                args.strategy != "fsdp-keep" and i < len(blocks) - 1))
        fully_shard(model, mp_policy=policy, reshard_after_forward=False)
        step_model = torch.compile(model) if args.strategy == "fsdp-whole" else model
    elif world > 1:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[local], gradient_as_bucket_view=True)
        if args.strategy == "ddp-bf16grad":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        step_model = torch.compile(ddp)
    else:
        step_model = torch.compile(model)
    # The step's peak, not the build's (under FSDP2 the model was built whole before sharding).
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    # As GPTLightningModule.configure_optimizers: weight decay on matrices, not on embeddings,
    # norms or biases (the parameters as the strategy left them: FSDP2's are DTensor shards).
    groups = {True: [], False: []}
    for name, p in model.named_parameters():
        groups[p.ndim >= 2 and name.split(".")[0] not in ("wte", "wpe")].append(p)
    optimizer = torch.optim.AdamW([{"params": groups[True], "weight_decay": 0.1},
                                   {"params": groups[False], "weight_decay": 0.0}],
                                  lr=6e-4, betas=(0.9, 0.95), fused=True)
    batches = torch.randint(0, config.vocab_size, (4, args.batch_size, T + 1), device=device)

    windows = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for step in range(args.steps):
        if step >= args.warmup and (step - args.warmup) % 10 == 0:
            if step > args.warmup:
                end.record()
                end.synchronize()
                windows.append(start.elapsed_time(end) / 10)
            start.record()
        batch = batches[step % len(batches)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_model(batch[:, :-1], batch[:, 1:])  # (B, T) inputs and targets
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    ms = statistics.median(windows)
    tok_s = args.batch_size * T / (ms / 1e3)
    flops = flops_per_token(config, T)
    peak = peak_for(torch.cuda.get_device_name(device))
    result = {"script": "plain_pytorch", "model": args.model, "gpus": world,
              "strategy": args.strategy if world > 1 else "single", "batch_size": args.batch_size,
              "seq_len": T, "activation_checkpointing": args.activation_checkpointing,
              "ms_per_step": round(ms, 2), "tok_s_per_gpu": round(tok_s),
              "mfu_pct": round(100 * mfu(tok_s, flops, peak.bf16), 1) if peak else None,
              "peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
              "loss": round(loss.item(), 3), "device": torch.cuda.get_device_name(device)}
    if local == 0:
        print(json.dumps(result), flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
