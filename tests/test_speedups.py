"""Speedups, the converter that makes a model this package did not build fast under
FP8Precision: its options, what it says where an option cannot act, and that it changes nothing
a CPU run needs (the graphs, compiled blocks, fused MLPs and FP32 weight gradients themselves run
on a GPU: tests/test_gpu_any_model.py)."""

import importlib

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend

from fp8_lightning import Speedups
from fp8_lightning.config import ConfigError
from fp8_lightning.fp8 import FP8Precision


def order() -> list[SDPBackend]:
    return [SDPBackend(b) for b in torch._C._get_sdp_priority_order()]


def test_options_are_true_false_or_unset_and_every_bad_one_is_named_at_once():
    with pytest.raises(ConfigError) as err:
        Speedups(cudnn_attention="on", fuse_mlp="yes", fuse_wgrad_accumulation=1.0)
    text = str(err.value)
    for problem in ("cudnn_attention='on'; valid: true, false", "fuse_mlp='yes'",
                    "fuse_wgrad_accumulation=1.0"):
        assert problem in text


def test_te_only_options_asked_for_a_torchao_run_are_said_to_be_off(caplog):
    speedups = Speedups(fuse_mlp=True, compile_blocks=True)
    with caplog.at_level("INFO", logger="fp8_lightning.speedups"):
        assert speedups.engine_options(nn.Linear(4, 4), "torchao") == {}
    assert "fuse_mlp, compile_blocks: off (engine torchao" in caplog.text


def test_options_left_at_their_defaults_say_nothing_where_they_cannot_act(caplog):
    """fuse_mlp / compile_blocks default on where they act (the TE engine's layers on one rank);
    unset, a run where they cannot act logs nothing of them."""
    speedups = Speedups()
    with caplog.at_level("INFO", logger="fp8_lightning.speedups"):
        assert speedups.engine_options(nn.Linear(4, 4), "torchao") == {}
        assert speedups.engine_options(nn.Linear(4, 4), "te") == {"fuse_mlp": None}
    assert "fuse_mlp" not in caplog.text and "compile_blocks" not in caplog.text


def test_this_packages_gpt_keeps_its_own_fast_path(caplog):
    from fp8_lightning.config import GPTConfig
    from fp8_lightning.model import GPT

    gpt = GPT(GPTConfig.from_name("tiny", n_layer=1, vocab_size=1000), backend="torch")
    speedups = Speedups(cuda_graphs=True, fuse_mlp=True)
    with caplog.at_level("INFO", logger="fp8_lightning.speedups"):
        assert speedups.engine_options(gpt, "te") == {}
        speedups.convert(gpt, engine="te", fp8=True, weights="bf16-mixed", swapped=[])
    assert "this package's GPT fuses its MLPs and graphs its blocks itself" in caplog.text
    assert "model.cuda_graphs" in caplog.text
    assert speedups.graphs is None and speedups.wgrad is None and not speedups.cudnn_first
    assert speedups.path is None  # no plan of its own for this package's GPT


def test_the_plan_says_why_a_model_gets_no_block_graphs():
    """The plan (fp8_lightning.fast_path.plan_model_graphs) is kept with its reasons; a BF16
    set-up (the fallback) keeps none."""
    speedups = Speedups()
    model = nn.Sequential(nn.ModuleList([nn.Linear(16, 16) for _ in range(2)]))
    speedups.convert(model, engine="torchao", fp8=True, weights="bf16-mixed", swapped=[])
    assert speedups.path.graphs is None and speedups.graphs is None
    assert speedups.path.graphs_why == "the torchao engine's modules are not captured; the TE " \
        "engine's are"
    speedups.convert(model, engine="torchao", fp8=False, weights="bf16-mixed", swapped=[])
    assert speedups.path is None


def test_without_a_gpu_pytorchs_attention_order_stays(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    own = importlib.import_module("examples.own_model")
    plugin = FP8Precision(recipe="tensorwise", converter=Speedups(cudnn_attention=True))
    plugin.convert_module(own.LitNanoGPT())
    assert not plugin.converter.cudnn_first
    before = order()
    with plugin.forward_context():
        assert order() == before


def test_a_config_names_the_converter_by_class_path(tmp_path, capsys, monkeypatch):
    """`converter: {class_path: fp8_lightning.Speedups, init_args: ...}` in a config: the doctor's
    check builds it, and fit trains with it (this package's GPT keeps its own fast path)."""
    from fp8_lightning.commands.run_config import check_fp8_plugin
    from tests._runs import ROOT, run_main

    monkeypatch.chdir(ROOT)
    plugin, problems = check_fp8_plugin({"recipe": "delayed", "converter": {
        "class_path": "fp8_lightning.Speedups", "init_args": {"cuda_graphs": False}}})
    assert problems == [] and isinstance(plugin.converter, Speedups)
    assert plugin.converter.cuda_graphs is False
    _, problems = check_fp8_plugin({"converter": {"class_path": "fp8_lightning.Speedups",
                                                  "init_args": {"fuse_mlp": "yes"}}})
    assert problems and "fuse_mlp='yes'" in problems[0]
    code, out, err = run_main(capsys, [
        "fit", "--config", "configs/quickstart.yaml", "--trainer.max_steps", "1",
        "--trainer.limit_val_batches", "0", "--trainer.default_root_dir", str(tmp_path),
        "--trainer.plugins.init_args.converter", "fp8_lightning.Speedups",
        "--trainer.plugins.init_args.converter.init_args.cuda_graphs", "false"])
    assert code == 0, err[-2000:]
    assert "done: step 1" in out + err
