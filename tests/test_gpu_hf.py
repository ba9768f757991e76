"""GPU: a Hugging Face GPT-2 converted in fine-tunes under FP8 on TE, and goes back out; a
user's Hugging Face Llama under FSDP2 fits FP8 twice in one process.

`python -m pytest -m gpu tests/test_gpu_hf.py -s` on the GPU machine (skips without CUDA/TE).
"""

import math

import lightning as L
import pytest
import torch

from fp8_lightning.data.streaming import EMBEDDED_CORPUS
from fp8_lightning.fp8 import FP8Precision
from fp8_lightning.fp8.te_engine import fp8_modules_ran
from fp8_lightning.commands.convert import checkpoint_to_hf
from fp8_lightning.hf import load_hf
from fp8_lightning.module import GPTLightningModule
from fp8_lightning.tokenizer import get_tokenizer

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

B, T = 8, 128


def test_converted_gpt2_fine_tunes_under_fp8_and_converts_back(tmp_path):
    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=50257, n_positions=T, n_embd=256, n_layer=4, n_head=4)).eval()
    reference.save_pretrained(tmp_path / "hf")
    ids = torch.tensor(get_tokenizer("gpt2").encode(EMBEDDED_CORPUS.read_text()[:200_000]))
    n = ids.numel() // (T + 1)
    blocks = ids[: n * (T + 1)].view(n, T + 1)
    module = GPTLightningModule(init_from=str(tmp_path / "hf"), backend="te", warmup_steps=5,
                                lr_decay_steps=60, learning_rate=1e-3)
    plugin = FP8Precision(recipe="delayed", on_unavailable="error")
    trainer = L.Trainer(max_steps=60, plugins=[plugin], accelerator="gpu", devices=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, gradient_clip_val=1.0,
                        default_root_dir=tmp_path)
    with torch.no_grad():  # the first loss is the reference model's on the same batch
        first = blocks[:B]
        hf_loss = reference(first[:, :-1], labels=first[:, :-1]).loss  # (shifts inside)
    trainer.fit(module, torch.utils.data.DataLoader(blocks, batch_size=B, drop_last=True))
    assert plugin.fp8_active and fp8_modules_ran(module.model)
    ckpt = tmp_path / "tuned.ckpt"
    trainer.save_checkpoint(ckpt)
    out = checkpoint_to_hf(str(ckpt), str(tmp_path / "out"))
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        tuned_loss = tuned(first[:, :-1], labels=first[:, :-1]).loss
    print(f"\n[hf fine-tune] loss on the first batch: HF start {hf_loss:.3f}, after 60 FP8 steps "
          f"{tuned_loss:.3f}")
    assert tuned_loss < hf_loss - 1.0  # it learned, in FP8, and the weights came back out
    config, state = load_hf(out)
    assert config.n_layer == 4 and state["wte.weight"].shape[0] == config.padded_vocab_size


def test_a_users_llama_under_fsdp2_fits_fp8_again_in_the_same_process(tmp_path):
    """``examples/hf_llama.py``'s module under FSDP2Strategy on one GPU, fitted twice (a
    notebook's second cell): the first fit swaps each projection for a te.Linear before it
    shards the layers; the second finds them swapped and sharded, and runs FP8 again on the
    same 14 te.Linear (the sharded LM head stays BF16), not the fallback."""
    from examples.hf_llama import LitLlama
    from fp8_lightning import FSDP2Strategy

    config = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 512,
              "intermediate_size": 1536, "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 4, "max_position_embeddings": 512,
              "tie_word_embeddings": False}
    from fp8_lightning.distributed import full_tensor

    torch.manual_seed(0)
    module = LitLlama(config, lr=1e-3, batch_size=4, seq_len=256)
    weights = []  # a swapped projection's weight after each fit
    for steps in (6, 12):
        plugin = FP8Precision(recipe="delayed", on_unavailable="error")
        trainer = L.Trainer(max_steps=steps, strategy=FSDP2Strategy(), accelerator="gpu",
                            devices=1, plugins=[plugin], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp_path)
        trainer.fit(module)
        assert plugin.status == "FP8 delayed", plugin.history
        assert len(plugin.engine.modules_ran(plugin.model)) == 2 * 7
        q_proj = module.model.model.layers[0]._checkpoint_wrapped_module.self_attn.q_proj
        weights.append(full_tensor(q_proj.weight.detach()).clone())
    losses = [float(v) for v in module.losses]
    assert len(losses) == 18 and all(math.isfinite(v) for v in losses)
    assert not torch.equal(*weights)  # the second fit trained the swapped layers
