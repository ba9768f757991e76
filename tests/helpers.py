"""Test-only callbacks, importable by class path from CLI runs (``tests.helpers.X``), and the
shared pieces of in-process tests (the console line's pattern, a token dataset, a checkpoint
without weights, what a run without FP8 records)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import time
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from fp8_lightning.te_availability import fallback_precision


# The GPU tests' small GPT-2 (every dim a multiple of 16, so it runs FP8) and its micro-batch.
GPU_SMALL = dict(n_layer=4, n_head=4, n_embd=256, ffn_hidden=1024, block_size=128)
GPU_B, GPU_T = 8, 128


# What a run without FP8 records here: bf16, or fp32 on a CPU without BF16 instructions.
FALLBACK = "fp32" if fallback_precision()[0] == "32-true" else "bf16"


# The console line, parsed the way a user's log scraper would.
LINE = re.compile(
    r"^step (?P<step>\d+) \| loss (?P<loss>\d+\.\d{4}|n/a) \| lr (?P<lr>\d\.\d{2}e[-+]\d{2}|n/a) \| "
    r"norm (?P<norm>\d+\.\d{3}|n/a) \| dt (?P<dt>\d+\.\d)ms \| tok/s (?P<tps>\d{1,3}(?:,\d{3})*) \| "
    r"mfu (?P<mfu>\d+\.\d%|n/a)(?: \| mfu_fp8 (?P<mfu_fp8>\d+\.\d%))? \| "
    r"(?P<tag>FP8 \w+|(?:BF16|FP32) \(fallback(?:: .+)?\)|\S+)$")


VOCAB = 512  # a small vocabulary: GPT-2's 50k would be most of each CPU step (ids < 512 are
# GPT-2 tokens too, so the monitor's text samples still decode)


class Tokens(torch.utils.data.Dataset):
    """64 sequences of 33 random token ids below ``VOCAB``, each seeded by its index."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.randint(0, VOCAB, (33,), generator=torch.Generator().manual_seed(i))


def logged_fit(root, steps=6, logger="csv"):
    """A tiny in-process fit logged by CSVLogger only (``logger="tensorboard"``: by
    TensorBoardLogger only): lines every 2 steps, a validation with a text sample at step 4 and a
    checkpoint save then."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from fp8_lightning.callbacks.monitor import TrainingMonitor
    from fp8_lightning.config import GPTConfig
    from fp8_lightning.fp8 import FP8Precision
    from fp8_lightning.module import GPTLightningModule

    monitor = TrainingMonitor(log_every=2, sample_prompt="The", sample_tokens=4, console=False)
    module = GPTLightningModule(config=GPTConfig(name="tiny", n_layer=1, block_size=32,
                                                 vocab_size=VOCAB), warmup_steps=1)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=4)
    trainer = L.Trainer(max_steps=steps, plugins=[FP8Precision()], accelerator="cpu",
                        logger={"csv": CSVLogger, "tensorboard": TensorBoardLogger}[logger](root),
                        log_every_n_steps=2, enable_progress_bar=False,
                        enable_model_summary=False, val_check_interval=4, limit_val_batches=1,
                        num_sanity_val_steps=0, callbacks=[monitor], default_root_dir=root)
    trainer.fit(module, loader, loader)
    return monitor, trainer


def small_checkpoint(path, step=0, val_loss=None, val_step=None, **config_fields):
    """A checkpoint as fit writes it, without weights (enough for everything before loading)."""
    from fp8_lightning.checkpoint_files import atomic_torch_save
    from fp8_lightning.config import GPTConfig

    config = dict(GPTConfig(name="tiny").to_dict(), **config_fields)
    atomic_torch_save({"state_dict": {}, "pytorch-lightning_version": "2.6.0", "global_step": step,
                       "tokens_seen": 0, "hyper_parameters": {"config": config},
                       "fp8_lightning": {"config": config, "precision": "bf16",
                                         "val_loss": val_loss, "val_step": val_step}}, path)
    return path


class BatchLog(Callback):
    """Appends ``{"step", "batch", "loss", "lr"}`` per training step to a JSON-lines file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._row: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        rows = batch.detach().cpu().contiguous().numpy()
        self._row = {"step": trainer.global_step, "batch": hashlib.sha1(rows.tobytes()).hexdigest(),
                     "samples": [hashlib.sha1(r.tobytes()).hexdigest()[:12] for r in rows],
                     "lr": trainer.optimizers[0].param_groups[0]["lr"]}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self._row.update(loss=float(outputs["loss"]), tokens_seen=pl_module.tokens_seen)
        with open(self.path, "a") as f:
            f.write(json.dumps(self._row) + "\n")


class KillAt(Callback):
    """SIGKILLs its own process at the start of step ``step`` (after the checkpoints of step-1)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class SignalAt(Callback):
    """Sends ``signal`` (``SIGTERM``, ``SIGINT``) ``times`` times while step ``step`` runs (at its
    batch start), to its own process, or with ``group`` to its whole process group (as a
    terminal's Ctrl-C or a scheduler does: the data-loader workers get it too; run the CLI in a
    new session); with ``rank``, on that global rank only."""

    def __init__(self, step: int, signal: str = "SIGTERM", group: bool = False,
                 times: int = 1, rank: Optional[int] = None) -> None:
        self.step, self.signal, self.group, self.times = step, signal, group, times
        self.rank = rank

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step == self.step - 1 and self.rank in (None, trainer.global_rank):
            signum = getattr(signal, self.signal)
            for _ in range(self.times):
                if self.group:
                    os.killpg(os.getpgrp(), signum)
                else:
                    os.kill(os.getpid(), signum)


from fp8_lightning.fp8 import FP8Precision  # noqa: E402


class PretendRan:
    """A plugin's FP8 engine, except that FP8 "ran" (nothing runs FP8 on a CPU): the plugin's
    check after the first FP8 step then finds it ran, as on a GPU."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def modules_ran(self, model):
        return ["pretend"]


class PretendFP8Precision(FP8Precision):
    """``FP8Precision`` whose FP8 switch is usable on a CPU ("FP8" runs as BF16 autocast).

    Only for tests of the *policy around* the switch (the NaN guard): the switch, its history
    and its checkpoint state are the real plugin's; what FP8 itself does is tested on the GPU.
    """

    def convert_module(self, module):
        module = super().convert_module(module)
        self.engine = PretendRan(self.engine)
        self.fp8_available = self.fp8_active = True
        self.reason = "pretend FP8 (CPU test)"
        return module


class Snapshots(Callback):
    """Copies of the model's parameters after the optimizer steps given."""

    def __init__(self, steps) -> None:
        self.steps, self.params = set(steps), {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step in self.steps:
            self.params[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]


class RankDigest(Callback):
    """At the end of training, writes ``<path>/rank<R>.txt``: a SHA-1 of this rank's parameters
    (replicas that took different optimizer steps have different digests)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        h = hashlib.sha1()
        for p in pl_module.parameters():
            h.update(p.detach().float().cpu().numpy().tobytes())
        os.makedirs(self.path, exist_ok=True)
        with open(os.path.join(self.path, f"rank{trainer.global_rank}.txt"), "w") as f:
            f.write(h.hexdigest())


class StepTimer(Callback):
    """ms per optimizer step from step `start` to the end (GPU tests): two syncs in all."""

    def __init__(self, start):
        self.start, self.t0, self.ms = start, None, None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.start:
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

    def on_train_end(self, trainer, module):
        torch.cuda.synchronize()
        self.ms = 1000 * (time.perf_counter() - self.t0) / (trainer.global_step - self.start)


class StrategySettings(Callback):
    """Writes ``rank<N>.json`` into ``path`` at train start: what the strategy applied to the
    model (DDP: the wrapper's bucket settings; FSDP2: each block's resharding and gather dtype)
    and where the rank runs (``layout``)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = trainer.strategy.model
        if isinstance(wrapped, DistributedDataParallel):
            settings = {"strategy": "ddp",
                        "gradient_as_bucket_view": wrapped.gradient_as_bucket_view,
                        "bucket_cap_mb": wrapped.bucket_bytes_cap / 2**20,
                        "find_unused_parameters": wrapped.find_unused_parameters}
        else:
            def fsdp(module):  # FSDP2's own record of how it shards the module (private API)
                group = module._get_fsdp_state()._fsdp_param_group
                return {"reshard_after_forward": group.post_forward_mesh_info is not None,
                        "param_dtype": str(group.mp_policy.param_dtype)}

            gpt = pl_module.model
            states = [b._get_fsdp_state() for b in gpt.blocks]  # one per unit of blocks
            settings = {"strategy": "fsdp2", "blocks": [fsdp(b) for b in gpt.blocks],
                        "root": fsdp(gpt), "units": len({id(s) for s in states})}
        # where the rank runs: its node, of how many (tests/_runs.py's rank_layouts)
        settings["layout"] = {"node_rank": trainer.node_rank, "num_nodes": trainer.num_nodes,
                              "local_rank": trainer.local_rank, "world_size": trainer.world_size}
        os.makedirs(self.path, exist_ok=True)
        with open(os.path.join(self.path, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(settings, f)


# What fp8_lightning.progress.duration writes (45s, 3m05s, 2h07m): an estimate made from the first
# few bytes of a run may be minutes or hours long.
DURATION = r"(\d+h\d\dm|(\d+m)?\d+s)"
