"""``python -m fp8_lightning convert``: Hugging Face model directories to and from this package's
checkpoints (the mapping itself: :mod:`fp8_lightning.hf`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..config import PRESETS, ConfigError
from ..hf import ARCHITECTURES, hf_config_from, load_hf, save_hf


def convert(output: str, from_hf: Optional[str] = None, to_hf: Optional[str] = None,
            tokenizer: Optional[str] = None) -> str:
    """Convert between Hugging Face model directories and this package's checkpoints.

    ``convert --from_hf DIR OUT.ckpt`` reads a local GPT-2 or Llama directory (config.json +
    safetensors; no network) into a checkpoint that ``generate`` and ``fit --model.init_from``
    take. ``convert --to_hf CKPT DIR`` writes a directory ``transformers`` loads as
    ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` from a checkpoint file or a sharded (FSDP) one.

    Args:
        output: the checkpoint file (``--from_hf``) or the new directory (``--to_hf``) to write.
        from_hf: a Hugging Face model directory.
        to_hf: a checkpoint of this package (a .ckpt file or a sharded checkpoint directory).
        tokenizer: ``--to_hf``: ``gpt2`` or a tokenizer.json to write beside the weights
            (default: the one the checkpoint was trained with, else gpt2).
    """
    if (from_hf is None) == (to_hf is None):
        raise ConfigError(["give exactly one of --from_hf DIR or --to_hf CHECKPOINT"], "convert")
    if from_hf is not None:
        return str(hf_to_checkpoint(from_hf, output))
    return str(checkpoint_to_hf(to_hf, output, tokenizer))


def hf_to_checkpoint(directory: str, output: str) -> Path:
    from lightning import __version__ as lightning_version

    from ..checkpoint_files import atomic_torch_save, checkpoint_versions
    from ..tokenizer import tokenizer_of

    dst = Path(output).expanduser()
    if dst.is_dir():
        raise ConfigError([f"{output!r} is a directory; valid: a file name such as "
                           f"{str(dst / 'model.ckpt')!r}"], "convert --from_hf")
    config, state = load_hf(directory)
    tokenizer = tokenizer_of(directory)
    checkpoint = {
        "state_dict": {"model." + k: v for k, v in state.items()},
        "hyper_parameters": {"config": config.to_dict()},
        "pytorch-lightning_version": lightning_version, "global_step": 0, "epoch": 0,
        "fp8_lightning": {"config": config.to_dict(), "versions": checkpoint_versions(),
                          "source": f"huggingface:{Path(directory).expanduser().resolve()}",
                          "tokenizer": tokenizer},
    }
    atomic_torch_save(checkpoint, dst)
    kind = "GPT-2" if config.position == "learned" else "Llama"
    print(f"{dst}: {kind} model ({config.n_layer} layers, hidden {config.n_embd}, "
          f"vocab {config.vocab_size} -> {config.padded_vocab_size}) from {directory}")
    return dst


def checkpoint_to_hf(checkpoint: str, output: str, tokenizer: Optional[str] = None) -> Path:
    from ..checkpoint_files import consolidate_checkpoint, recorded_config

    ckpt = consolidate_checkpoint(checkpoint)
    config = recorded_config(ckpt, checkpoint)
    if config is None:
        raise ConfigError([f"{checkpoint}: no model config (hyper_parameters['config']): not an "
                           "fp8-lightning checkpoint"], "convert --to_hf")
    state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()
             if not k.endswith("_extra_state")}
    tokenizer = tokenizer or (ckpt.get("fp8_lightning") or {}).get("tokenizer") or \
        (ckpt.get("datamodule_hyper_parameters") or {}).get("tokenizer")
    note = "tokenizer"
    if tokenizer is None and config.vocab_size == PRESETS["gpt2"]["vocab_size"]:
        tokenizer = "gpt2"  # an old or hand-made checkpoint with GPT-2's vocabulary
    elif tokenizer is None:  # guessing GPT-2's would decode another vocabulary as garbage
        note = (f"no tokenizer: the checkpoint records none and its vocabulary "
                f"({config.vocab_size}) is not GPT-2's; add --tokenizer PATH")
    path = save_hf(config, state, output, tokenizer)
    print(f"{path}: {ARCHITECTURES[hf_config_from(config)['model_type']]} (config.json, "
          f"model.safetensors, {note}) from {checkpoint}")
    return path
