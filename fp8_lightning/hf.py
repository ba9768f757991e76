"""Hugging Face weights in and out: GPT-2 (``GPT2LMHeadModel``) and Llama (``LlamaForCausalLM``,
3.1 / 3.2's RoPE scaling included), with Qwen2 (q/k/v biases) and Mistral (no sliding window) read
as Llama-shaped models;
``model.init_from`` reads through it, the ``convert`` command (:mod:`fp8_lightning.commands.convert`)
writes.

A Hugging Face directory is ``config.json`` plus ``model.safetensors`` (or sharded
``model-*.safetensors`` with ``model.safetensors.index.json``) and the tokenizer files. Reading
one needs ``safetensors`` only (no ``transformers``, no network); safetensors holds tensors, never
code, so nothing is unpickled.

The layouts differ from this package's in four places, all handled here:

* GPT-2's ``Conv1D`` stores weights (in, out): transposed to ``nn.Linear``'s (out, in).
* QKV: GPT-2's ``c_attn`` is already [q; k; v]; Llama's ``q_proj``/``k_proj``/``v_proj`` are
  concatenated into the fused ``qkv`` in that order. SwiGLU: ``gate_proj``/``up_proj`` become
  ``fc1`` = [gate; up] (TE's convention: the gate is the first half).
* The vocabulary is padded (50257 -> 50304) with zero rows going in and sliced off going out.
* Qwen2's q/k/v biases are concatenated into ``qkv.bias`` as the weights are.
* RoPE: Hugging Face Llama rotates halves (``rotate_half``), as :func:`~fp8_lightning.model.apply_rope`
  does, so q/k weights are copied as they are (no interleave permutation).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from .config import ROPE_SCALING_KEYS, ConfigError, GPTConfig

# config.json keys -> GPTConfig fields, per architecture (model_type).
GPT2_KEYS = {"vocab_size": "vocab_size", "n_positions": "block_size", "n_layer": "n_layer",
             "n_head": "n_head", "n_embd": "n_embd", "layer_norm_epsilon": "norm_eps"}
LLAMA_KEYS = {"vocab_size": "vocab_size", "max_position_embeddings": "block_size",
              "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
              "num_key_value_heads": "n_kv_heads", "hidden_size": "n_embd",
              "intermediate_size": "ffn_hidden", "rms_norm_eps": "norm_eps"}
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                 "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Read as Llama: the same layers and names (Mistral: without a sliding window; Qwen2: with
# biases on q, k and v). Written back as Llama, or as Qwen2 where the QKV has a bias.
LLAMA_FAMILY = ("llama", "mistral", "qwen2")
# GPT-2's tanh GELU under its Hugging Face names (plain "gelu" is the exact erf form: not ours).
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


# ------------------------------------------------------------------------------------ config
def read_config(directory: str | os.PathLike) -> dict[str, Any]:
    """``DIR/config.json`` as a dict; one error naming the file when it is missing or unreadable."""
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"Hugging Face model directory {str(path)!r} does not exist (a "
                                "directory with config.json and *.safetensors)")
    file = path / "config.json"
    if not file.is_file():
        found = ", ".join(sorted(p.name for p in path.iterdir())[:6]) or "nothing"
        raise ConfigError([f"no config.json (found: {found}); valid: a directory saved by "
                             "transformers' save_pretrained (config.json + *.safetensors)"],
                            str(path))
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError([f"not valid JSON ({err})"], str(file)) from None
    if not isinstance(config, dict):
        raise ConfigError(["the top level must be an object"], str(file))
    return config


def gpt_config_from_hf(hf: dict[str, Any], where: str = "config.json") -> GPTConfig:
    """The :class:`GPTConfig` of a Hugging Face GPT-2 or Llama ``config.json``; every field this
    package cannot represent is listed in one error."""
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        raise ConfigError([f"model_type={kind!r} is not supported; valid: "
                             f"{', '.join(ARCHITECTURES)} (architectures {', '.join(ARCHITECTURES.values())})"],
                            where)
    problems = []
    keys = GPT2_KEYS if kind == "gpt2" else LLAMA_KEYS
    missing = [k for k in keys if k not in hf and not (k == "num_key_value_heads")]
    if missing:
        raise ConfigError([f"{k}: missing (a {kind} config.json has it)" for k in missing], where)
    fields = {ours: hf[theirs] for theirs, ours in keys.items() if hf.get(theirs) is not None}
    tie = hf.get("tie_word_embeddings", kind == "gpt2")
    if kind == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        if act not in TANH_GELU:
            problems.append(f"activation_function={act!r}; valid: {', '.join(TANH_GELU)} (the "
                            "tanh GELU)")
        fields["ffn_hidden"] = hf.get("n_inner") or 4 * hf["n_embd"]
        if not tie:
            problems.append("tie_word_embeddings=false: GPT2LMHeadModel ties the LM head to the "
                            "embedding; valid: true")
        name = "gpt2"
    else:
        if hf.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act={hf.get('hidden_act')!r}; valid: silu (SwiGLU)")
        for key in ("attention_bias", "mlp_bias"):
            if hf.get(key):
                problems.append(f"{key}=true; valid: false (this package's Llama has no biases; "
                                "Qwen2's q/k/v biases are read as model_type qwen2)")
        window = hf.get("sliding_window")
        if window is not None and (kind == "mistral" or hf.get("use_sliding_window")) \
                and window < hf["max_position_embeddings"]:
            problems.append(f"sliding_window={window}: attention over a window is not supported; "
                            "valid: null (full causal attention)")
        if kind == "qwen2":
            fields["qkv_bias"] = True
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "llama3":  # Llama 3.1 / 3.2
            fields["rope_scaling"] = {"rope_type": "llama3",
                                      **{k: rope.get(k) for k in ROPE_SCALING_KEYS}}
        elif rope_type != "default":
            problems.append(f"rope scaling {rope_type!r} (rope_scaling/rope_parameters) is not "
                            "supported; valid: default (Llama 3.0), llama3 (Llama 3.1, 3.2)")
        theta = hf.get("rope_theta") or rope.get("rope_theta")
        if theta is not None:
            fields["rope_theta"] = float(theta)
        head_dim = hf.get("head_dim")
        if head_dim is not None and head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
            fields["head_size"] = head_dim  # the attention is wider or narrower than the stream
        fields["tie_embeddings"] = bool(tie)
        name = "llama3-8b"
    if problems:
        raise ConfigError(problems, where)
    fields["norm_eps"] = float(fields["norm_eps"])
    try:
        return GPTConfig(name=name, **fields)
    except ConfigError as err:  # shapes FP8 cannot take (multiples of 16)
        raise ConfigError([f"as GPTConfig: {p}" for p in err.problems], where) from None


def hf_config_from(config: GPTConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of a model; one error when neither architecture fits."""
    c = config
    gpt2 = dict(norm="layernorm", activation="gelu", position="learned", bias=True,
                qkv_bias=True, tie_embeddings=True, qk_norm=False, head_size=None)
    llama = dict(norm="rmsnorm", activation="swiglu", position="rope", bias=False,
                 qkv_bias=False, qk_norm=False)
    qwen2 = dict(llama, qkv_bias=True)
    for kind, needs in (("gpt2", gpt2), ("llama", llama), ("qwen2", qwen2)):
        if all(getattr(c, k) == v for k, v in needs.items()):
            break
    else:
        wrong = [f"{k}={getattr(c, k)!r}" for k, v in gpt2.items() if getattr(c, k) != v]
        raise ConfigError([f"this model ({', '.join(wrong)}) is neither GPT-2 "
                           f"({', '.join(f'{k}={v}' for k, v in gpt2.items())}) nor Llama "
                           f"({', '.join(f'{k}={v}' for k, v in llama.items())})"],
                          "convert --to_hf")
    common = {"architectures": [ARCHITECTURES[kind]], "model_type": kind,
              "vocab_size": c.vocab_size, "torch_dtype": "float32"}
    if kind == "gpt2":
        return {**common, "n_positions": c.block_size, "n_ctx": c.block_size, "n_embd": c.n_embd,
                "n_layer": c.n_layer, "n_head": c.n_head, "n_inner": c.ffn_hidden,
                "activation_function": "gelu_new", "layer_norm_epsilon": c.norm_eps,
                "tie_word_embeddings": True, "bos_token_id": 50256, "eos_token_id": 50256}
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling:  # transformers 5 reads rope_parameters, earlier versions rope_scaling
        rope = {**c.rope_scaling, "rope_theta": c.rope_theta}
        common["rope_scaling"] = dict(c.rope_scaling)
    return {**common, "hidden_size": c.n_embd, "intermediate_size": c.ffn_hidden,
            "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head,
            "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim,
            "max_position_embeddings": c.block_size, "rms_norm_eps": c.norm_eps,
            "hidden_act": "silu", "mlp_bias": False,
            **({} if kind == "qwen2" else {"attention_bias": False}),
            "tie_word_embeddings": bool(c.tie_embeddings), "rope_theta": c.rope_theta,
            "rope_parameters": rope}


# ------------------------------------------------------------------------------- weight names
def _gpt2_names(n_layer: int) -> list[tuple[str, str, bool]]:
    """(ours, Hugging Face's, transposed) for GPT-2; HF keys without the ``transformer.`` prefix."""
    names = [("wte.weight", "wte.weight", False), ("wpe.weight", "wpe.weight", False),
             ("norm_f.weight", "ln_f.weight", False), ("norm_f.bias", "ln_f.bias", False)]
    for i in range(n_layer):
        b, h = f"blocks.{i}.", f"h.{i}."
        names += [(b + "qkv.layer_norm_weight", h + "ln_1.weight", False),
                  (b + "qkv.layer_norm_bias", h + "ln_1.bias", False),
                  (b + "qkv.weight", h + "attn.c_attn.weight", True),
                  (b + "qkv.bias", h + "attn.c_attn.bias", False),
                  (b + "proj.weight", h + "attn.c_proj.weight", True),
                  (b + "proj.bias", h + "attn.c_proj.bias", False),
                  (b + "mlp.layer_norm_weight", h + "ln_2.weight", False),
                  (b + "mlp.layer_norm_bias", h + "ln_2.bias", False),
                  (b + "mlp.fc1_weight", h + "mlp.c_fc.weight", True),
                  (b + "mlp.fc1_bias", h + "mlp.c_fc.bias", False),
                  (b + "mlp.fc2_weight", h + "mlp.c_proj.weight", True),
                  (b + "mlp.fc2_bias", h + "mlp.c_proj.bias", False)]
    return names


def _llama_names(n_layer: int, tied: bool, qkv_bias: bool = False
                 ) -> list[tuple[str, tuple[str, ...]]]:
    """(ours, Hugging Face's parts concatenated along dim 0) for Llama (and Qwen2's q/k/v
    biases)."""
    names = [("wte.weight", ("model.embed_tokens.weight",)), ("norm_f.weight", ("model.norm.weight",))]
    if not tied:
        names.append(("lm_head.weight", ("lm_head.weight",)))
    for i in range(n_layer):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        names += [(b + "qkv.layer_norm_weight", (h + "input_layernorm.weight",)),
                  (b + "qkv.weight", tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv")),
                  *([(b + "qkv.bias", tuple(h + f"self_attn.{p}_proj.bias" for p in "qkv"))]
                    if qkv_bias else []),
                  (b + "proj.weight", (h + "self_attn.o_proj.weight",)),
                  (b + "mlp.layer_norm_weight", (h + "post_attention_layernorm.weight",)),
                  (b + "mlp.fc1_weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight")),
                  (b + "mlp.fc2_weight", (h + "mlp.down_proj.weight",))]
    return names


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero rows appended up to ``rows`` (the padded vocabulary: never looked up or predicted)."""
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


# ------------------------------------------------------------------------------------ in
def read_safetensors(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of ``DIR/model.safetensors`` or of the shards its index names (CPU)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(directory).expanduser()
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as err:
            raise ConfigError([f"not a safetensors index ({type(err).__name__}: {err}); it needs "
                                 "a weight_map"], str(index)) from None
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        why = (f"only pickled weights ({', '.join(pickled)}), which are never unpickled here; "
               "re-save them with save_pretrained(..., safe_serialization=True)") if pickled \
            else "no model.safetensors or model.safetensors.index.json"
        raise ConfigError([why], str(path))
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        file = path / name
        if not file.is_file():
            raise ConfigError([f"the index names {name}, which does not exist"], str(index))
        try:
            tensors.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError) as err:
            raise ConfigError([f"not a readable safetensors file ({err})"], str(file)) from None
    return tensors


def state_dict_from_hf(config: GPTConfig, kind: str, tensors: dict[str, torch.Tensor],
                       where: str) -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> this package's parameter names, shapes and padded vocabulary."""
    tensors = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    if kind == "gpt2":
        pairs = [(ours, (theirs,), t) for ours, theirs, t in _gpt2_names(config.n_layer)]
    else:
        pairs = [(ours, theirs, False) for ours, theirs in
                 _llama_names(config.n_layer, config.tie_embeddings, config.qkv_bias)]
    missing = sorted({t for _, theirs, _ in pairs for t in theirs if t not in tensors})
    if missing:
        raise ConfigError([f"tensor {m!r} is missing (the config says {config.n_layer} "
                             f"{kind} layers)" for m in missing[:5]]
                            + ([f"... and {len(missing) - 5} more"] if len(missing) > 5 else []),
                            where)
    state = {}
    for ours, theirs, transposed in pairs:
        parts = [tensors[t].t() if transposed else tensors[t] for t in theirs]
        state[ours] = (torch.cat(parts) if len(parts) > 1 else parts[0]).contiguous()
    state["wte.weight"] = _pad_rows(state["wte.weight"], config.padded_vocab_size)
    if "wpe.weight" in state:
        state["wpe.weight"] = state["wpe.weight"][: config.block_size]
    if config.tie_embeddings:
        state["lm_head.weight"] = state["wte.weight"]
    else:
        state["lm_head.weight"] = _pad_rows(state["lm_head.weight"], config.padded_vocab_size)
    return state


def load_hf(directory: str | os.PathLike) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """A Hugging Face GPT-2 or Llama directory -> (config, state dict of :class:`GPT`)."""
    path = Path(directory).expanduser()
    hf = read_config(path)
    config = gpt_config_from_hf(hf, str(path / "config.json"))
    return config, state_dict_from_hf(config, hf["model_type"], read_safetensors(path), str(path))


def load_into(model: torch.nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Copy ``state`` into ``model`` (either backend); shapes checked, every mismatch in one error.
    TE's ``_extra_state`` (FP8 scaling) starts fresh."""
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    problems = [f"{k}: {tuple(state[k].shape)} in {where}, the model has {tuple(v.shape)}"
                for k, v in own.items() if k in state and state[k].shape != v.shape]
    problems += [f"{k}: missing from {where}" for k in own if k not in state]
    if problems:
        raise ConfigError(problems[:8], "model.init_from (shape mismatch)")
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(state[name])


# --------------------------------------------------------------------- model.init_from
def _is_hf_directory(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def init_source(init_from: str) -> tuple[GPTConfig, Optional[str]]:
    """What ``model.init_from`` describes: its model config and the tokenizer its weights were
    trained with (``gpt2``, a path, or None when it does not say). Read once per run (the module
    asks when it is built and again at ``setup``), again when the files change."""
    path = Path(init_from).expanduser()
    marker = path / "config.json" if _is_hf_directory(path) else path
    stamp = marker.stat().st_mtime_ns if marker.exists() else None
    config, tokenizer = _init_source(init_from, stamp)
    return dataclasses.replace(config), tokenizer


@functools.lru_cache(maxsize=4)
def _init_source(init_from: str, stamp: Optional[int]) -> tuple[GPTConfig, Optional[str]]:
    from .checkpoint_files import is_sharded_checkpoint, load_checkpoint_file, recorded_config
    from .tokenizer import tokenizer_of

    path = Path(init_from).expanduser()
    if _is_hf_directory(path):
        return gpt_config_from_hf(read_config(path), str(path / "config.json")), tokenizer_of(path)
    if path.is_file() or is_sharded_checkpoint(path):
        checkpoint = load_checkpoint_file(path, mmap=True)
        config = recorded_config(checkpoint, path)
        if config is None:
            raise ConfigError([f"model.init_from={init_from!r}: the checkpoint has no model config "
                               "(not an fp8-lightning checkpoint); valid: a Hugging Face model "
                               "directory or a checkpoint of this package"], "model")
        return config, (checkpoint.get("fp8_lightning") or {}).get("tokenizer")
    if path.is_dir():
        raise ConfigError([f"model.init_from={init_from!r} is a directory without config.json: "
                           "neither a Hugging Face model directory nor a sharded checkpoint"],
                          "model")
    raise FileNotFoundError(f"model.init_from={init_from!r} does not exist (a Hugging Face "
                            "model directory or a checkpoint file)")


def init_config(init_from: str, config: Optional[GPTConfig]) -> GPTConfig:
    """The model config of ``model.init_from`` (a Hugging Face directory or a checkpoint of this
    package); a ``config`` the user also set must describe the same model (one error listing
    every field that differs)."""
    source = init_source(init_from)[0]
    if config is not None:
        theirs, ours = source.to_dict(), config.to_dict()
        diffs = [f"model.config.{k}={ours[k]!r} but {init_from} has {k}={v!r}"
                 for k, v in theirs.items() if k != "name" and ours[k] != v]
        if diffs:
            raise ConfigError(diffs + ["with model.init_from leave model.config unset (the shape "
                                       "comes from the weights) or set it to the same values"],
                              "model")
    return source


def init_weights(model: torch.nn.Module, init_from: str) -> None:
    """Copy the weights of ``model.init_from`` into a freshly built model (either backend)."""
    from .checkpoint_files import consolidate_checkpoint

    path = Path(init_from).expanduser()
    if _is_hf_directory(path):
        state = load_hf(path)[1]
    else:
        ckpt = consolidate_checkpoint(path)
        state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()}
    load_into(model, state, init_from)


# ------------------------------------------------------------------------------------ out
def state_dict_to_hf(config: GPTConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This package's state dict -> Hugging Face names and layouts, padded rows dropped."""
    kind = hf_config_from(config)["model_type"]
    vocab = config.vocab_size
    out: dict[str, torch.Tensor] = {}
    if kind == "gpt2":
        for ours, theirs, transposed in _gpt2_names(config.n_layer):
            t = state[ours][:vocab] if ours == "wte.weight" else state[ours]
            out["transformer." + theirs] = t.t() if transposed else t
        return {k: v.contiguous() for k, v in out.items()}
    c = config
    qkv = [c.attn_width, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim]
    sizes = {"qkv.weight": qkv, "qkv.bias": qkv, "mlp.fc1_weight": [c.ffn_hidden, c.ffn_hidden]}
    for ours, theirs in _llama_names(c.n_layer, c.tie_embeddings, c.qkv_bias):
        t = state[ours]
        if ours in ("wte.weight", "lm_head.weight"):
            t = t[:vocab]
        parts = t.split(sizes[ours.split(".", 2)[-1]]) if len(theirs) > 1 else (t,)
        out.update(zip(theirs, parts))
    return {k: v.contiguous() for k, v in out.items()}


def write_tokenizer(tokenizer: str, directory: Path, config: GPTConfig) -> list[str]:
    """The tokenizer files ``AutoTokenizer.from_pretrained`` reads; returns their names."""
    from .tokenizer import ASSETS, byte_level_bpe, get_tokenizer

    tok = get_tokenizer(tokenizer)  # validates the name or path
    eot = tok.decode([tok.eot_id])
    if tokenizer == "gpt2":  # the package's GPT-2 BPE files are Hugging Face's under other names
        shutil.copyfile(ASSETS / "gpt2" / "encoder.json", directory / "vocab.json")
        shutil.copyfile(ASSETS / "gpt2" / "vocab.bpe", directory / "merges.txt")
        byte_level_bpe(directory / "vocab.json", directory / "merges.txt").save(
            str(directory / "tokenizer.json"))
        written, cls = ["vocab.json", "merges.txt", "tokenizer.json"], "GPT2Tokenizer"
    else:
        source = Path(tokenizer).expanduser()
        if source.is_dir():
            files = [n for n in ("tokenizer.json", "vocab.json", "merges.txt")
                     if (source / n).is_file()]
            for name in files:
                shutil.copyfile(source / name, directory / name)
        else:
            shutil.copyfile(source, directory / "tokenizer.json")
            files = ["tokenizer.json"]
        written, cls = files, "PreTrainedTokenizerFast"
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": cls, "model_max_length": config.block_size, "bos_token": eot,
         "eos_token": eot, "unk_token": eot if tokenizer == "gpt2" else None,
         "add_prefix_space": False}, indent=2))
    return written + ["tokenizer_config.json"]


def save_hf(config: GPTConfig, state: dict[str, torch.Tensor], directory: str | os.PathLike,
            tokenizer: Optional[str] = "gpt2") -> Path:
    """Write a directory ``transformers`` loads (config.json, model.safetensors, tokenizer files;
    ``tokenizer=None``: no tokenizer files).

    Written beside the target and renamed into place, so a failure leaves nothing half-written;
    an existing non-empty directory is never overwritten."""
    from safetensors.torch import save_file

    from .checkpoint_files import publish_directory, temporary_beside

    path = Path(directory).expanduser()
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError([f"{str(path)!r} exists and is not empty; valid: a new directory "
                           "(nothing there is overwritten)"], "convert --to_hf")
    hf_config = hf_config_from(config)
    tensors = state_dict_to_hf(config, state)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_beside(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": hf_config.get("bos_token_id"),
             "eos_token_id": hf_config.get("eos_token_id")}, indent=2))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            write_tokenizer(tokenizer, tmp, config)
        if path.exists():
            path.rmdir()  # empty (checked above)
        publish_directory(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
