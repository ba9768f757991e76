"""``python -m fp8_lightning generate --ckpt PATH --prompt TEXT``: sample from a checkpoint.

Works for checkpoints of either backend on either backend, on CPU or GPU: the model is rebuilt
from the checkpoint's ``hyper_parameters["config"]``; both backends share parameter names, and
TE's FP8 ``_extra_state`` entries are dropped (sampling runs BF16 on a GPU, fp32 on a CPU, never
FP8, so any prompt length works).
"""

from __future__ import annotations

import logging
import shlex
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Literal, Optional

import torch

from ..checkpoint_files import consolidate_checkpoint, recorded_config
from ..config import ConfigError
from ..model import GPT

log = logging.getLogger(__name__)


def read_model_checkpoint(ckpt: str) -> dict[str, Any]:
    """The checkpoint, validated like every load (``checkpoint.load_checkpoint_file``), that
    also carries a model config; a sharded (FSDP) checkpoint directory is gathered in memory."""
    path = Path(ckpt).expanduser()
    checkpoint = consolidate_checkpoint(path)  # a CheckpointError names the file and why
    if recorded_config(checkpoint, path) is None:
        raise ConfigError([f"{path} has no model config (hyper_parameters['config']): not an "
                           "fp8-lightning checkpoint"], "checkpoint")
    return checkpoint


def load_model(ckpt: str, device: str = "auto", backend: str = "auto"
               ) -> tuple[GPT, dict[str, Any], torch.device]:
    """The GPT of a checkpoint on ``device`` (``auto``/``cpu``/``cuda``) with ``backend``."""
    from ..te_availability import te_status

    problems = []
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        problems.append(f"device={device!r}; valid: auto, cpu, cuda, cuda:N")
    if backend not in ("auto", "te", "torch"):
        problems.append(f"backend={backend!r}; valid: auto, te, torch")
    if problems:
        raise ConfigError(problems, "generate")
    checkpoint = read_model_checkpoint(ckpt)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError([f"device={device!r} but no CUDA GPU is visible; use device=cpu"], "generate")
    te_ok, reason = te_status()
    if backend == "auto":
        backend = "te" if te_ok and device.startswith("cuda") else "torch"
    if backend == "te" and not (te_ok and device.startswith("cuda")):
        raise ConfigError([f"backend='te' needs TransformerEngine on a GPU ({reason}); use "
                           "backend=torch (checkpoints of both backends load into it)"], "generate")
    hp = checkpoint.get("hyper_parameters") or {}
    config = recorded_config(checkpoint, ckpt)
    attention = hp.get("attention", "sdpa") if backend == "te" else "sdpa"
    torch_device = torch.device(device)
    if backend == "te" and torch_device.index is not None:
        torch.cuda.set_device(torch_device)
    model = GPT(config, backend=backend, attention=attention).to(torch_device)
    prefix = "model."
    state = {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)
             and not k.endswith("_extra_state")}  # FP8 scaling state: nothing to do in BF16
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ConfigError([f"{ckpt}: the weights do not fit the model in its config "
                           f"(missing: {missing[:5]}, unexpected: {unexpected[:5]})"], "checkpoint")
    return model.eval(), checkpoint, torch_device


def other_tokenizer(passed: str, recorded: str, tok: Any, vocab_size: int
                    ) -> Optional[tuple[str, str]]:
    """(why, what to pass instead) where the tokenizer ``passed`` (loaded: ``tok``) is not
    ``recorded``, the one the checkpoint was trained with; None where it is, or where nothing
    here can tell."""
    from ..tokenizer import tokenizer_key

    if passed == recorded:
        return None
    key = tokenizer_key(recorded)
    if key == "gpt2" or key.startswith("sha256:"):  # its files are here: compare the contents
        if tokenizer_key(passed) == key:
            return None
        return ("its text would decode as garbage",
                f"pass --tokenizer {shlex.quote(recorded)} or leave --tokenizer out")
    # Its files are not on this machine (a copy of them is what --tokenizer is then for): only a
    # vocabulary larger than the model's rules a tokenizer out.
    if tok.vocab_size <= vocab_size:
        return None
    return (f"its {tok.vocab_size:,} tokens are more than the model's vocab_size={vocab_size}",
            f"pass --tokenizer PATH to a copy of {recorded!r}, which is not here")


def generate(ckpt: str, prompt: str = "", max_new_tokens: int = 100, temperature: float = 0.8,
             top_k: Optional[int] = 200, seed: int = 1337,
             device: Literal["auto", "cpu", "cuda"] = "auto",
             backend: Literal["auto", "te", "torch"] = "auto",
             tokenizer: Optional[str] = None, force_tokenizer: bool = False) -> str:
    """Generate text from a checkpoint; returns (and the command prints) prompt + continuation.

    Args:
        ckpt: a checkpoint written by ``fit`` (``last.ckpt``, ...), from either backend.
        prompt: the text to continue (empty: start from the end-of-text token).
        max_new_tokens: tokens to generate.
        temperature: sampling temperature; 0 is greedy.
        top_k: sample among the k most likely tokens (``null``: all).
        seed: random seed.
        device: ``auto`` (CUDA if visible), ``cpu`` or ``cuda``.
        backend: ``auto`` (TE on a GPU with TE, else PyTorch), ``te`` or ``torch``.
        tokenizer: ``gpt2`` or a tokenizer.json (default: the one the checkpoint was trained with;
            another one is refused).
        force_tokenizer: decode with ``tokenizer`` even where it is not the one the checkpoint
            was trained with (a warning says so).
    """
    from ..tokenizer import get_tokenizer

    problems = []
    if max_new_tokens < 0:
        problems.append(f"max_new_tokens={max_new_tokens} must be >= 0")
    if temperature < 0:
        problems.append(f"temperature={temperature} must be >= 0 (0: greedy)")
    if top_k is not None and top_k < 1:
        problems.append(f"top_k={top_k} must be >= 1 (or null)")
    if problems:
        raise ConfigError(problems, "generate")
    model, checkpoint, torch_device = load_model(ckpt, device=device, backend=backend)
    # The tokenizer the model was trained with (recorded in the checkpoint); GPT-2 BPE only for
    # checkpoints from before it was recorded. Decoding with another one prints garbage.
    recorded = (checkpoint.get("fp8_lightning") or {}).get("tokenizer") or \
        (checkpoint.get("datamodule_hyper_parameters") or {}).get("tokenizer")
    name = tokenizer or recorded or "gpt2"
    try:
        tok = get_tokenizer(name)
    except ValueError as err:
        detail = "; ".join(getattr(err, "problems", [str(err)]))
        if tokenizer is None and recorded:
            raise ConfigError([f"the checkpoint was trained with tokenizer {recorded!r}, which "
                               f"cannot be loaded here ({detail}); pass --tokenizer PATH to that "
                               "tokenizer.json"], "generate") from None
        raise ConfigError([detail], "generate") from None
    problem = other_tokenizer(tokenizer, recorded, tok, model.config.vocab_size) \
        if tokenizer is not None and recorded else None
    if problem and not force_tokenizer:
        why, fix = problem
        raise ConfigError([f"--tokenizer {tokenizer!r} is not the tokenizer this checkpoint was "
                           f"trained with, {recorded!r} ({why}); {fix}, or add --force_tokenizer "
                           f"true to decode with {tokenizer!r} anyway"], "generate")
    if problem:
        log.warning("decoding with --tokenizer %r because of --force_tokenizer, though the "
                    "checkpoint was trained with %r: expect garbage", tokenizer, recorded)
    ids = tok.encode(prompt) if prompt else [tok.eot_id]
    if max(ids) >= model.config.vocab_size:
        raise ConfigError([f"tokenizer {name!r} produced id {max(ids)} but the model's vocab_size "
                           f"is {model.config.vocab_size}; pass the checkpoint's tokenizer"],
                          "generate")
    torch.manual_seed(seed)
    idx = torch.tensor([ids], dtype=torch.long, device=torch_device)
    cuda = torch_device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()
    with torch.no_grad(), autocast:
        out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k,
                             vocab_size=tok.vocab_size)
    new = out[0, len(ids):].tolist()
    return (prompt if prompt else "") + tok.decode(new)
