"""What a CUDA graph should replay: the whole stack of blocks or each block (session 12).

GPT-2 124M, FP8 delayed, on one GPU: bench's step (ms/step by CUDA events, host ms by bench's
probe) for per-block graphs and for one graph of the whole stack, alternated, at 8 x 1024 and
16 x 1024, beside the compiled BF16 baseline; then fit's loop at 8 x 1024 (NaNGuard +
TrainingMonitor, steps 55-115, as tests/test_gpu_fast_path.py) for both; then where the host time
of one step goes (torch.profiler, CPU side, the stack's step at 8 x 1024).

Usage on the GPU machine: python scripts/graph_probe.py OUT_DIR
"""
import sys
from pathlib import Path
import lightning as L
import torch
sys.path.insert(0, ".")
import fp8_lightning.graphs as graphs
from fp8_lightning.measure import build_step, parse_variant, host_ms
from fp8_lightning.config import GPTConfig
from fp8_lightning.module import GPTLightningModule
from fp8_lightning.fp8 import FP8Precision
from fp8_lightning.callbacks.guard import NaNGuard
from fp8_lightning.callbacks.monitor import TrainingMonitor
from fp8_lightning.data.streaming import EMBEDDED_CORPUS
from fp8_lightning.tokenizer import get_tokenizer
from tests.helpers import StepTimer

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
FP8 = dict(recipe="delayed", weights="bf16-mixed", on_unavailable="error")
print(torch.cuda.get_device_name(), flush=True)


def timed(step, n=20):
    for _ in range(8): step()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n): step()
    b.record(); b.synchronize()
    return a.elapsed_time(b) / n


def build(name, B, T, stack):
    graphs.WHOLE_STACK = stack
    step, _ = build_step(parse_variant(name), GPTConfig(name="gpt2"), B, T, device=dev,
                         module_class=GPTLightningModule, fp8_args=FP8)
    return step


for B in (8, 16):
    steps = {"torch-compile": build("torch-compile", B, 1024, True),
             "fp8-delayed blocks": build("fp8-delayed", B, 1024, False),
             "fp8-delayed stack": build("fp8-delayed", B, 1024, True)}
    res = {k: [] for k in steps}
    hosts = {k: [] for k in steps}
    for r in range(3):
        for k, step in steps.items():
            res[k].append(timed(step))
            hosts[k].append(host_ms(step, dev)[0])
    base = min(res["torch-compile"])
    for k in steps:
        print(f"[bench {B}x1024] {k:22s} ms/step {[round(x, 2) for x in res[k]]} best {min(res[k]):.2f} "
              f"speedup {base / min(res[k]):.3f}  host ms {hosts[k]}", flush=True)
    if B == 8:
        from torch.profiler import profile, ProfilerActivity
        step = steps["fp8-delayed stack"]
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5): step()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        (out / "host_profile_stack.txt").write_text(table)
        print(table[:6000], flush=True)
        torch.cuda.synchronize()
    del steps
    torch._dynamo.reset(); torch.cuda.empty_cache()


ids = torch.tensor(get_tokenizer("gpt2").encode(EMBEDDED_CORPUS.read_text()))
T = 1024
n = ids.numel() // (T + 1)
blocks = ids[: n * (T + 1)].view(n, T + 1).repeat(4, 1)


def fit(stack):
    graphs.WHOLE_STACK = stack
    L.seed_everything(0)
    module = GPTLightningModule(config=GPTConfig(name="gpt2"), warmup_steps=10, lr_decay_steps=200)
    loader = torch.utils.data.DataLoader(blocks, batch_size=8, shuffle=False, drop_last=True, pin_memory=True)
    t = StepTimer(55)
    trainer = L.Trainer(max_steps=115, plugins=[FP8Precision(recipe="delayed")], accelerator="gpu", devices=1,
        logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        limit_val_batches=0, gradient_clip_val=1.0, default_root_dir=str(out / "fit"),
        callbacks=[t, NaNGuard(), TrainingMonitor(log_every=10, sample_prompt=None, console=False)])
    trainer.fit(module, loader)
    return t.ms


for r in range(2):
    for stack in (False, True):
        print(f"[fit 8x1024] {'stack' if stack else 'blocks'}: {fit(stack):.2f} ms/step", flush=True)
