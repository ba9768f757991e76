"""Your own model under the FP8 plugin: a nanoGPT-style GPT written with plain ``torch.nn``
(``nn.Linear``, ``nn.LayerNorm``, ``F.scaled_dot_product_attention``), in your own
``LightningModule``, trained with ``Trainer(plugins=[FP8Precision(...)])``.

    python examples/own_model.py --steps 20

The plugin finds the model's blocks (its longest ``nn.ModuleList``, here ``transformer.h``) and
its LM head (``lm_head``) for the layer policy, runs every other ``nn.Linear`` whose dims are
multiples of 16 in FP8 (torchao's ``tensorwise`` in place; a TE recipe such as ``delayed`` swaps
it for a ``te.Linear`` holding the same parameters), keeps the LM head in BF16,
checks after the first step that FP8 really ran, and falls back to BF16 (or FP32 on a CPU without
BF16 instructions) with the reason where FP8 cannot run. Its checkpoints are unchanged by it: the
same parameter names and state-dict keys with FP8 or without, on either engine. Its converter,
``Speedups()``, makes the TE engine's run fast on one GPU: the blocks replay as CUDA graphs of
their compiled forward, the MLPs run as one ``te.LayerNormMLP``, the weight gradients sum in FP32.
"""

from __future__ import annotations

import argparse
import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from fp8_lightning import Speedups
from fp8_lightning.fp8 import RECIPES, FP8Precision


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.mlp_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class NanoGPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int,
                 n_embd: int) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer)),
            ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as GPT-2
        for name, p in self.named_parameters():
            if p.ndim == 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(T, device=idx.device))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab_size)


class LitNanoGPT(L.LightningModule):
    def __init__(self, vocab_size: int = 512, block_size: int = 64, n_layer: int = 4,
                 n_head: int = 4, n_embd: int = 128, lr: float = 1e-3,
                 compile: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = NanoGPT(vocab_size, block_size, n_layer, n_head, n_embd)

    def on_fit_start(self) -> None:
        # Compiled here, after the plugin converted the model at setup (in place: the
        # parameter names stay those of the model, for checkpoints with FP8 or without).
        if self.hparams.compile:
            self.model.compile()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--recipe", default="tensorwise", choices=list(RECIPES),
                        help="tensorwise / rowwise (torchao) or delayed / current / block (TE)")
    parser.add_argument("--devices", default="auto",
                        help="GPUs to train on: a count, or auto (all; several run DDP)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        parser.error("--steps and --batch_size must be at least 1")
    if args.devices != "auto" and not (args.devices.isdigit() and int(args.devices) > 0):
        parser.error(f"--devices must be a positive count or auto (got {args.devices!r})")
    L.seed_everything(0)
    module = LitNanoGPT()
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 512, (args.batch_size * args.steps, 1), generator=g)
    data = (starts + 7 * torch.arange(65)) % 512  # a learnable sequence: each token + 7
    # Speedups: CUDA graphs of the blocks, fused MLPs, FP32 weight gradients (TE engine, one GPU)
    plugin = FP8Precision(recipe=args.recipe, converter=Speedups())
    trainer = L.Trainer(max_steps=args.steps, plugins=[plugin], logger=False,
                        devices=args.devices if args.devices == "auto" else int(args.devices),
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=1.0)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=args.batch_size))
    print(f"precision: {plugin.status}; BF16 modules: {dict(plugin.bf16_modules) or 'none'}; "
          f"final train loss {float(trainer.callback_metrics['train/loss']):.4f}")
    return {"plugin": plugin, "module": module, "trainer": trainer}


if __name__ == "__main__":
    main()
