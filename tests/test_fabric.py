"""Lightning Fabric: the FP8 plugin and the NaN guard in a Fabric loop (here: the CPU fallback).

FP8 itself under Fabric runs in tests/test_gpu_fabric.py.
"""

import importlib
import logging
import re
import subprocess
import sys

import lightning as L
import pytest
import torch

from fp8_lightning.config import ConfigError, GPTConfig
from fp8_lightning.fabric import FabricFP8Precision, FabricNaNGuard
from fp8_lightning.fp8 import FP8Precision
from fp8_lightning.model import GPT
from fp8_lightning.te_availability import fallback_precision
from tests._runs import ROOT
from tests.helpers import PretendRan

B, T = 2, 32
# A small vocabulary: the 50k GPT-2 one makes the LM head and its AdamW update most of a step.
TINY = GPTConfig(name="tiny", n_layer=1, vocab_size=1024)


class PretendFP8(FabricFP8Precision):
    """A FabricFP8Precision whose FP8 switch is usable on a CPU, for the guard's policy (as
    tests.helpers.PretendFP8Precision for the Trainer); what FP8 does is tested on the GPU."""

    def convert_module(self, module):
        module = super().convert_module(module)
        self.engine = PretendRan(self.engine)
        self.fp8_available = self.fp8_active = True
        self.reason = "pretend FP8 (CPU test)"
        return module


def set_up(plugin=None, seed=0, **guard):
    plugin = plugin or FabricFP8Precision()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(seed)
    model = GPT(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    model, optimizer = fabric.setup(model, optimizer)
    guard = FabricNaNGuard(fabric, model, optimizer, **{"check_every": 2, **guard})
    return fabric, plugin, model, optimizer, guard


BATCH = torch.randint(0, 1000, (B, T + 1), generator=torch.Generator().manual_seed(0))


def train(fabric, model, optimizer, guard, start, stop, poison=()):
    """The loop of examples/fabric_train.py on one batch (the curve depends on the state alone)."""
    losses = []
    for step in range(start, stop):
        loss = model(BATCH[:, :-1], BATCH[:, 1:])
        if step in poison:
            loss = loss * float("nan")
        fabric.backward(loss)
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        guard.before_optimizer_step(loss, norm)
        optimizer.step()
        optimizer.zero_grad()
        guard.after_optimizer_step()
        losses.append(loss.item())
    guard.end()
    return losses


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_fabric_loop_falls_back_with_the_reason_and_resumes_exactly(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        fabric, plugin, model, optimizer, guard = set_up()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("FP8 is not available: ") for m in warnings), warnings
    expected = {"bf16-mixed": "bf16", "32-true": "fp32"}[fallback_precision()[0]]
    assert not plugin.fp8_active and plugin.effective_precision == expected
    assert plugin.history[-1]["event"] == "unavailable" and "fallback: " in plugin.status

    losses = train(fabric, model, optimizer, guard, 0, 3)
    path = tmp_path / "fabric.ckpt"
    state = {"model": model, "optimizer": optimizer, "fp8": plugin, "guard": guard, "step": 3}
    fabric.save(path, state)
    saved = params(model)
    losses += train(fabric, model, optimizer, guard, 3, 6)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.5, losses

    ckpt = torch.load(path, weights_only=True)  # plain types and tensors only
    assert ckpt["fp8"]["effective_precision"] == expected and ckpt["guard"]["global_step"] == 3

    fabric2, plugin2, model2, optimizer2, guard2 = set_up(seed=1)  # other weights, until loaded
    state2 = {"model": model2, "optimizer": optimizer2, "fp8": plugin2, "guard": guard2, "step": 0}
    assert fabric2.load(path, state2) == {}
    assert state2["step"] == 3 and guard2.global_step == 3
    assert all(torch.equal(a, b) for a, b in zip(params(model2), saved))
    opt_a, opt_b = ckpt["optimizer"]["state"], optimizer2.state_dict()["state"]
    assert opt_a.keys() == opt_b.keys() and all(
        torch.equal(opt_a[k][name], opt_b[k][name]) for k in opt_a for name in opt_a[k])
    assert plugin2.history[: len(ckpt["fp8"]["history"])] == ckpt["fp8"]["history"]
    assert plugin2.reason == plugin.reason
    train(fabric2, model2, optimizer2, guard2, 3, 6)
    assert all(torch.equal(a, b) for a, b in zip(params(model2), params(model)))


def test_outputs_come_back_fp32_from_a_bf16_forward(monkeypatch):
    import fp8_lightning.fp8.plugin as plugin

    monkeypatch.setattr(plugin, "fallback_precision", lambda: ("bf16-mixed", "BF16 (test)"))
    fabric, plugin, model, _, _ = set_up()
    inside = []
    model.module.lm_head.register_forward_hook(lambda m, a, out: inside.append(out.dtype))
    logits = model(BATCH[:, :-1])
    assert plugin.effective_precision == "bf16" and inside == [torch.bfloat16]
    assert logits.dtype == torch.float32  # as Fabric's own bf16-mixed returns them


def test_a_converter_under_fabric_is_told_each_forward_backward_and_step_end():
    """Fabric's forwards do not say when a step starts: the plugin tells a converter each training
    forward, each backward and, after each optimizer step, that the step ended (where
    ``Speedups``' block graphs mark their replays spent)."""
    from contextlib import contextmanager

    from fp8_lightning.fp8.converter import ModelConverter

    class Recorder(ModelConverter):  # a converter of a user's, as the plugin sees it
        def __init__(self):
            self.calls = []

        def convert(self, model, *, engine, fp8, weights, swapped):
            self.calls.append(("convert", fp8))

        @contextmanager
        def training_forward(self, step_start):
            self.calls.append(("forward", step_start))
            yield

        def before_backward(self):
            self.calls.append("backward")

        def step_end(self):
            self.calls.append("step_end")

    recorder = Recorder()
    fabric, plugin, model, optimizer, guard = set_up(FabricFP8Precision(converter=recorder))
    assert recorder.calls == [("convert", plugin.fp8_active)]
    train(fabric, model, optimizer, guard, 0, 2)
    assert recorder.calls[1:] == [("forward", False), "backward", "step_end"] * 2


def test_the_trainer_plugin_under_fabric_names_the_fabric_one():
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FP8Precision()])
    model = fabric.setup(GPT(TINY))
    with pytest.raises(TypeError, match="with Fabric use fp8_lightning.fabric.FabricFP8Precision"):
        fabric.backward(model(BATCH[:, :-1], BATCH[:, 1:]))


def test_fabric_guard_skips_rolls_back_to_bf16_and_reenables_fp8():
    fabric, plugin, model, optimizer, guard = set_up(
        PretendFP8(), max_bad_steps=3, window=10, bf16_steps=4, snapshot_every=2)
    train(fabric, model, optimizer, guard, 0, 14, poison=(4, 5, 6))
    assert [(e["event"], e["step"]) for e in guard.events] == [
        ("skipped", 4), ("skipped", 5), ("skipped", 6), ("rollback", 8), ("bf16_fallback", 8),
        ("fp8_reenabled", 12)]
    assert "in-memory snapshot of step 4" in guard.events[3]["detail"]
    assert [(h["event"], h["step"]) for h in plugin.history][-2:] == [("disabled", 8), ("enabled", 12)]
    assert plugin.fp8_active and all(torch.isfinite(p).all() for p in model.parameters())
    assert guard.state_dict()["global_step"] == 14 and guard.fp8_incidents == 1


def test_fabric_guard_arguments():
    with pytest.raises(ConfigError, match="FabricNaNGuard.rollback='checkpoint' needs the Trainer"):
        FabricNaNGuard(None, None, None, rollback="checkpoint")
    with pytest.raises(ConfigError, match="FabricNaNGuard.check_every=0 must be an integer"):
        FabricNaNGuard(None, None, None, check_every=0)


def test_the_example_trains_saves_and_resumes(tmp_path, capsys):
    example = importlib.import_module("examples.fabric_train")
    args = ["--ckpt", str(tmp_path / "last.ckpt"), "--n_layer", "1", "--batch_size", "2",
            "--seq_len", "32", "--corpus_chars", "20000", "--log_every", "1",
            "--accelerator", "cpu"]
    first = example.main(args + ["--steps", "2"])
    assert first["step"] == 2 and (tmp_path / "last.ckpt").is_file()
    second = example.main(args + ["--steps", "3"])
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 2" in out and "val loss" in out
    assert second["step"] == 3 and len(second["losses"]) == 1
    assert all(torch.isfinite(torch.tensor(r["losses"] + [r["val_loss"]])).all() for r in (first, second))


def test_the_example_under_fsdp2_on_two_ranks_saves_shards_and_resumes_exactly(tmp_path):
    """``--strategy fsdp --devices 2`` (two gloo ranks): the model sharded per block, the checkpoint
    a directory of shards, and a resumed run's step-3 loss the uninterrupted run's."""
    def run(ckpt, steps):
        result = subprocess.run(
            [sys.executable, "examples/fabric_train.py", "--ckpt", str(ckpt), "--n_layer", "2",
             "--batch_size", "2", "--seq_len", "32", "--corpus_chars", "20000", "--log_every", "1",
             "--save_every", "2", "--steps", str(steps), "--accelerator", "cpu", "--devices", "2",
             "--strategy", "fsdp"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout, dict(re.findall(r"^step +(\d+) \| loss ([\d.]+)", result.stdout, re.M))

    _, whole = run(tmp_path / "whole.ckpt", 3)
    run(tmp_path / "last.ckpt", 2)
    assert (tmp_path / "last.ckpt").is_dir() and (tmp_path / "last.ckpt" / "meta.pt").is_file()
    assert len(list((tmp_path / "last.ckpt").glob("*.distcp"))) == 2  # one shard per rank
    out, resumed = run(tmp_path / "last.ckpt", 3)
    assert "at step 2" in out and list(resumed) == ["3"]
    assert resumed["3"] == whole["3"], (resumed, whole)
    # The FP8 plugin's and the guard's state came back too (Fabric's sharded load hands them
    # back as dicts): the saved run's plugin event and this run's, the guard at the saved step
    assert "(FP8 plugin history: 2 events; NaN guard at step 2)" in out, out[-1500:]


def test_the_example_refuses_a_checkpoint_of_the_other_layout(tmp_path, capsys):
    """A sharded checkpoint (a directory) resumes only under FSDP2 and a file only without it:
    one error line naming the way out, before any training."""
    example = importlib.import_module("examples.fabric_train")
    (tmp_path / "sharded.ckpt").mkdir()
    (tmp_path / "one.ckpt").write_bytes(b"")
    for ckpt, strategy in (("sharded.ckpt", "ddp"), ("one.ckpt", "fsdp")):
        with pytest.raises(SystemExit) as exit_:
            example.parse_args(["--ckpt", str(tmp_path / ckpt), "--strategy", strategy,
                                "--devices", "2"])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert re.match(r"\S+: error: --ckpt ", err) and "--fresh" in err, err
    example.parse_args(["--ckpt", str(tmp_path / "sharded.ckpt"), "--strategy", "ddp", "--fresh"])
    with pytest.raises(SystemExit):
        example.parse_args(["--strategy", "fsdp", "--devices", "auto"])
    assert "--strategy fsdp needs --devices N" in capsys.readouterr().err
