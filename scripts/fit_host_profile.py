"""Host-time profile (cProfile) of bench's step and of fit's loop: GPT-2 124M, FP8 delayed, 8 x 1024.

Usage on the GPU machine: python scripts/fit_host_profile.py OUT_DIR fp8-delayed,torch-compile
Writes OUT_DIR/<variant>.{tottime,cumtime}.txt and fit.{tottime,cumtime}.txt; prints ms per step.
"""
import cProfile, io, pstats, sys, time
from pathlib import Path
import lightning as L
import torch
sys.path.insert(0, ".")
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
B, T = 8, 1024
FP8 = dict(recipe="delayed", weights="bf16-mixed", on_unavailable="error")

def dump(pr, name, steps):
    for key in ("tottime", "cumtime"):
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats(key).print_stats(70)
        (out / f"{name}.{key}.txt").write_text(f"# {steps} steps\n" + s.getvalue())

for name in sys.argv[2].split(","):
    step, plugin = build_step(parse_variant(name), GPTConfig(name="gpt2"), B, T, device=dev,
                              module_class=GPTLightningModule, fp8_args=FP8)
    for _ in range(10): step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(30): step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 30 * 1e3
    hosts = [host_ms(step, dev)[0] for _ in range(3)]
    torch.cuda._sleep(4_000_000_000)
    pr = cProfile.Profile(); pr.enable()
    for _ in range(20): step()
    pr.disable()
    print(f"[{name}] wall {wall:.2f} ms/step, host {hosts}", flush=True)
    dump(pr, name, 20)
    del step, plugin
    torch._dynamo.reset(); torch.cuda.empty_cache()

class Prof(L.Callback):
    def __init__(s): s.pr = cProfile.Profile(); s.t0 = None
    def on_train_batch_end(s, trainer, *a):
        if trainer.global_step == 55:
            torch.cuda.synchronize(); s.t0 = time.perf_counter(); s.pr.enable()
    def on_train_end(s, trainer, *a):
        s.pr.disable(); torch.cuda.synchronize()
        s.ms = (time.perf_counter() - s.t0) * 1e3 / (trainer.global_step - 55)

ids = torch.tensor(get_tokenizer("gpt2").encode(EMBEDDED_CORPUS.read_text()))
n = ids.numel() // (T + 1)
blocks = ids[: n * (T + 1)].view(n, T + 1).repeat(4, 1)

def fit(cbs, tag):
    L.seed_everything(0)
    module = GPTLightningModule(config=GPTConfig(name="gpt2"), warmup_steps=10, lr_decay_steps=200)
    loader = torch.utils.data.DataLoader(blocks, batch_size=B, shuffle=False, drop_last=True, pin_memory=True)
    trainer = L.Trainer(max_steps=115, plugins=[FP8Precision(recipe="delayed")], accelerator="gpu", devices=1,
        logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        limit_val_batches=0, gradient_clip_val=1.0, default_root_dir=str(out / tag), callbacks=cbs)
    trainer.fit(module, loader)

for tag, extra in (("bare", []), ("cbs", [NaNGuard(), TrainingMonitor(log_every=10, sample_prompt=None, console=False)])):
    t = StepTimer(55); fit([t, *extra], tag); print(f"[fit {tag}] {t.ms:.2f} ms/step", flush=True)
p = Prof(); fit([p, NaNGuard(), TrainingMonitor(log_every=10, sample_prompt=None, console=False)], "prof")
print(f"[fit prof] {p.ms:.2f} ms/step (under cProfile)", flush=True)
dump(p.pr, "fit", 60)
