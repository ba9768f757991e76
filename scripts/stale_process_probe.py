"""Does a process that ran earlier fits train slower? (TE global FP8 buffers, dynamo caches, GC.)

Usage on the GPU machine: python scripts/stale_process_probe.py N_EARLIER_FITS (docs/benchmarks.md, session 11).
"""
import gc, sys, time
import lightning as L
import torch
sys.path.insert(0, ".")
from fp8_lightning.config import GPTConfig
from fp8_lightning.module import GPTLightningModule
from fp8_lightning.fp8 import FP8Precision
from fp8_lightning.data.streaming import EMBEDDED_CORPUS
from fp8_lightning.tokenizer import get_tokenizer
from transformer_engine.pytorch.quantization import FP8GlobalStateManager as M

B, T = 8, 1024
ids = torch.tensor(get_tokenizer("gpt2").encode(EMBEDDED_CORPUS.read_text()))
n = ids.numel() // (T + 1)
blocks = ids[: n * (T + 1)].view(n, T + 1).repeat(4, 1)
gc_ms = [0.0]; _t = [0.0]
def gccb(phase, info):
    if phase == "start": _t[0] = time.perf_counter()
    else: gc_ms[0] += (time.perf_counter() - _t[0]) * 1e3
gc.callbacks.append(gccb)

class Timer(L.Callback):
    def on_train_batch_end(s, trainer, *a):
        if trainer.global_step == 55:
            torch.cuda.synchronize(); s.t0 = time.perf_counter(); s.g0 = gc_ms[0]
    def on_train_end(s, trainer, *a):
        torch.cuda.synchronize(); k = trainer.global_step - 55
        s.ms = (time.perf_counter() - s.t0) * 1e3 / k; s.gc = (gc_ms[0] - s.g0) / k

def fit(steps, n_layer=12, recipe="delayed", cbs=()):
    L.seed_everything(0)
    module = GPTLightningModule(config=GPTConfig(name="gpt2", n_layer=n_layer), warmup_steps=10, lr_decay_steps=200)
    loader = torch.utils.data.DataLoader(blocks, batch_size=B, shuffle=False, drop_last=True, pin_memory=True)
    trainer = L.Trainer(max_steps=steps, plugins=[FP8Precision(recipe=recipe)], accelerator="gpu", devices=1,
        logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        limit_val_batches=0, gradient_clip_val=1.0, default_root_dir="/tmp/stale", callbacks=list(cbs))
    trainer.fit(module, loader)

def timed(tag):
    t = Timer(); fit(115, cbs=[t])
    print(f"[{tag}] {t.ms:.2f} ms/step, gc {t.gc:.2f} ms/step, TE amax buffer keys {len(M.quantization_state.global_amax_buffer)}, "
          f"gc objects {len(gc.get_objects())}", flush=True)

timed("fresh")
for i in range(int(sys.argv[1])):
    fit(12, n_layer=4, recipe=("delayed", "current")[i % 2])
timed(f"after {sys.argv[1]} small fits")
M.reset()
timed("after FP8GlobalStateManager.reset()")
gc.collect(); gc.freeze()
timed("after gc.freeze()")
