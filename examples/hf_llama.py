"""A Hugging Face ``LlamaForCausalLM`` of your own, sharded with FSDP2 and trained in FP8.

Random weights from a config (a Llama 3.2 3B or Llama 3 8B shape, or your ``config.json``; no
download), in your own ``LightningModule``, trained by ``L.Trainer`` with
``FP8Precision(recipe=...)`` and ``FSDP2Strategy()``:

    python examples/hf_llama.py --devices 4 --strategy fsdp --preset llama3-8b --steps 20 \\
        --ckpt runs/llama/last.ckpt --export runs/llama/hf
    python examples/hf_llama.py --devices 4 --strategy fsdp --preset llama3-8b --steps 40 \\
        --resume runs/llama/last.ckpt          # or --config_json path/to/config.json

``FSDP2Strategy`` finds the model's repeated blocks (here ``model.model.layers``) as it finds
this package's GPT's and shards the decoder layers as its units (a layer each at 8B; smaller
layers grouped into units of about 200M parameters, as for the GPT), then the model (BF16
gathers, fp32 gradient reduction). A TE recipe (``delayed``) swaps each projection's ``nn.Linear`` for a
``te.Linear`` holding the same parameters, before the sharding; the LM head stays BF16. The
memory check runs before the model is built (``--no-memory_check`` skips it: it estimates this
package's GPT of the same shape), the checkpoint is a directory of shards that resumes on any
number of GPUs, a resumed run reads on from the batch where the checkpoint stopped, and
``--export`` writes a directory that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
import transformers
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from fp8_lightning import FSDP2Strategy
from fp8_lightning.config import ConfigError, GPTConfig
from fp8_lightning.fp8 import RECIPES, FP8Precision
from fp8_lightning.fp8.plugin import fp8_plugin
from fp8_lightning.hf import gpt_config_from_hf, hf_config_from
from fp8_lightning.layers import checkpoint
from fp8_lightning.memory_check import check_memory, is_gpu_fit, run_shape
from fp8_lightning.te_availability import te_available

# the shapes of this package's presets, as Hugging Face config.json dicts
PRESETS = {name: hf_config_from(GPTConfig.from_name(name)) for name in ("llama3.2-3b", "llama3-8b")}


class LitLlama(L.LightningModule):
    def __init__(self, config: dict[str, Any], lr: float = 3e-4,
                 activation_checkpointing: bool = True, batch_size: int = 1,
                 seq_len: int = 2048, memory_check: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = transformers.LlamaConfig.from_dict(config)
        self.model: Optional[nn.Module] = None
        self.fits_one_gpu: Optional[bool] = None  # the memory check's: FSDP2Strategy's layout
        self.losses: list[torch.Tensor] = []
        self.first_row, self.first_step = 0, 0  # where this fit's reading starts (resumed: on)

    def configure_model(self) -> None:
        if self.model is not None:
            return
        trainer = self._trainer
        self.check_memory()
        # Whole on this rank's device (an 8B's fp32 weights: 32 GB), where Hugging Face
        # initialises it fast; FSDP2Strategy then keeps this rank's shard of each parameter.
        with torch.device(trainer.strategy.root_device if trainer is not None else "cpu"):
            model = transformers.LlamaForCausalLM(self.config)
        if self.hparams.activation_checkpointing:
            # torch's wrapper, not Hugging Face's gradient_checkpointing_enable: FSDP2 shards the
            # wrapper, so its hooks (the gather, the inputs' cast to BF16) stay outside the
            # recompute (Hugging Face's recomputes them, and PyTorch < 2.13 skips the cast there:
            # pytorch/pytorch#159359); with TE installed the checkpoint is TE's, whose recompute
            # runs in the forward's FP8 (torch's runs outside TE's FP8 region).
            recompute = functools.partial(checkpoint, "te" if te_available() else "torch")
            for i, layer in enumerate(model.model.layers):
                model.model.layers[i] = checkpoint_wrapper(layer, checkpoint_fn=recompute)
        self.model = model

    def check_memory(self) -> None:
        """This package's memory check on the Llama's shapes (a GPU fit only): the estimate per
        GPU logged, a run that cannot fit stopped with the levers that would make it fit."""
        trainer = self._trainer
        if not (self.hparams.memory_check and is_gpu_fit(trainer)):
            return
        try:
            config = gpt_config_from_hf(self.config.to_dict())
        except ConfigError as err:
            rank_zero_warn(f"memory check skipped: {err}")
            return
        plugin = fp8_plugin(trainer)
        backend = plugin.engine.backend if plugin is not None else "torch"
        data = SimpleNamespace(batch_size=self.hparams.batch_size, seq_len=self.hparams.seq_len)
        checkpointing = "full" if self.hparams.activation_checkpointing else "none"
        run = run_shape(trainer, data, config, backend, activation_checkpointing=checkpointing,
                        activation_checkpointing_every=1, compiled_loss=False)
        check = check_memory(trainer, config, run, backend=backend, step_graph=False)
        self.fits_one_gpu = check.fits_one_gpu
        check.enforce(True)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(input_ids=batch[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        self.log("train/loss", loss, prog_bar=True)
        self.losses.append(loss.detach())
        return loss

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        """This rank's rows from the first no step has read (a plain DataLoader would start its
        epoch over on a resume): the checkpoint keeps the count, so a resume on another number
        of GPUs reads on as well."""
        trainer = self.trainer
        self.first_step = trainer.global_step  # resumed: the checkpoint's step
        rows = Rows(self.config.vocab_size, self.hparams.seq_len, self.first_row,
                    trainer.global_rank, trainer.world_size)
        return torch.utils.data.DataLoader(rows, batch_size=self.hparams.batch_size)

    def rows_read(self) -> int:
        """Rows every rank's steps have read so far, this fit's and those it resumed from."""
        trainer = self.trainer
        return (self.first_row + (trainer.global_step - self.first_step)
                * self.hparams.batch_size * trainer.world_size)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rows_read"] = self.rows_read()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.first_row = checkpoint.get("rows_read", 0)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def export(self, directory: str) -> None:
        """The trained weights as a Hugging Face directory. Every rank calls it: the shards are
        gathered whole onto rank 0's CPU, which writes them (the Hugging Face parameter names:
        the checkpoint wrapper's are dropped, the swapped TE layers keep the user's)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        if self.trainer.is_global_zero:
            with torch.device("meta"):
                out = transformers.LlamaForCausalLM(self.config)
            out.load_state_dict(state, assign=True)
            out.save_pretrained(directory)
        self.trainer.strategy.barrier("hf_export")


class Rows(torch.utils.data.IterableDataset):
    """One rank's rows of :func:`learnable_tokens` from row ``first`` on: ``first + rank``, then
    every ``world``-th. Endless, as a stream: the Trainer stops at ``max_steps``. (A map-style
    loader of the rows left would end a resumed epoch early: Lightning restores the epoch's batch
    count, and the loader would start over.)"""

    def __init__(self, vocab_size: int, seq_len: int, first: int, rank: int, world: int) -> None:
        super().__init__()
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.first, self.rank, self.world = first, rank, world

    def __iter__(self):
        row = self.first + self.rank
        while True:
            yield learnable_tokens(self.vocab_size, 1, self.seq_len, first=row)[0]
            row += self.world


def learnable_tokens(vocab_size: int, samples: int, seq_len: int, first: int = 0) -> torch.Tensor:
    """Rows ``first`` to ``first + samples`` of ``seq_len + 1`` tokens, each the one before + 7
    (as own_model.py); a row's first token is a hash of its index, so any stretch of rows is
    the same wherever it starts."""
    starts = (torch.arange(first, first + samples).unsqueeze(1) * 2654435761) % vocab_size
    return (starts + 7 * torch.arange(seq_len + 1)) % vocab_size


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (a bad value: one ``error:`` line, exit status 2)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--preset", default="llama3.2-3b", choices=list(PRESETS))
    shape.add_argument("--config_json", help="a Llama config.json: its shape, random weights")
    parser.add_argument("--devices", default="auto", help="GPUs: a count, or auto (all)")
    parser.add_argument("--strategy", default="fsdp", choices=["fsdp", "ddp"])
    parser.add_argument("--recipe", default="delayed", choices=list(RECIPES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch_size", type=int, default=1, help="per GPU")
    parser.add_argument("--seq_len", type=int, default=2048, help="a multiple of 8 (TE's FP8)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--activation_checkpointing", action=argparse.BooleanOptionalAction,
                        default=True, help="recompute each decoder layer in the backward")
    parser.add_argument("--memory_check", action=argparse.BooleanOptionalAction, default=True,
                        help="stop before training where the estimate per GPU does not fit")
    parser.add_argument("--ckpt", help="write the (sharded) checkpoint here after training")
    parser.add_argument("--resume", help="resume from this checkpoint")
    parser.add_argument("--export", help="write the trained model here, a Hugging Face directory")
    args = parser.parse_args(argv)
    if min(args.steps, args.batch_size, args.seq_len) < 1 or args.seq_len % 8:
        parser.error("--steps, --batch_size must be >= 1 and --seq_len a positive multiple of 8")
    if args.devices != "auto" and not (args.devices.isdigit() and int(args.devices) > 0):
        parser.error(f"--devices must be a positive count or auto (got {args.devices!r})")
    if args.resume and not Path(args.resume).exists():
        parser.error(f"--resume {args.resume!r}: no such checkpoint (a file or a directory of "
                     "shards that --ckpt wrote)")
    args.config = PRESETS[args.preset]
    if args.config_json:
        try:
            args.config = json.loads(Path(args.config_json).read_text())
            transformers.LlamaConfig.from_dict(args.config)
        except (OSError, ValueError, TypeError) as err:
            parser.error(f"--config_json {args.config_json!r}: {type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''} (a Llama config.json)")
        if not isinstance(args.config, dict):
            parser.error(f"--config_json {args.config_json!r}: not a JSON object (a Llama "
                         "config.json)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = arguments(argv)
    config = args.config
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    L.seed_everything(0)  # the same random weights on every rank
    module = LitLlama(config, lr=args.lr, activation_checkpointing=args.activation_checkpointing,
                      batch_size=args.batch_size, seq_len=args.seq_len,
                      memory_check=args.memory_check)
    plugin = FP8Precision(recipe=args.recipe)
    trainer = L.Trainer(max_steps=args.steps, plugins=[plugin], logger=False,
                        strategy=FSDP2Strategy() if args.strategy == "fsdp" else "ddp",
                        devices=args.devices if args.devices == "auto" else int(args.devices),
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=1.0)
    trainer.fit(module, ckpt_path=args.resume)
    if args.ckpt:
        trainer.save_checkpoint(args.ckpt)
    if args.export:
        module.export(args.export)
    if trainer.is_global_zero:
        print(f"precision: {plugin.status}; steps {trainer.global_step}; losses: "
              + " ".join(f"{float(loss):.4f}" for loss in module.losses))
    return {"plugin": plugin, "module": module, "trainer": trainer}


if __name__ == "__main__":
    main()
