"""GPU: FP8 under Lightning Fabric with real TransformerEngine (`pytest -m gpu` on the GPU machine).

Skips cleanly without CUDA/TE (see conftest.py).
"""

import importlib

import lightning as L
import pytest
import torch

from fp8_lightning.config import GPTConfig
from fp8_lightning.data.streaming import EMBEDDED_CORPUS
from fp8_lightning.fabric import FabricFP8Precision, FabricNaNGuard
from fp8_lightning.fp8.scaling_state import export_fp8_scaling
from fp8_lightning.fp8.te_engine import fp8_modules_ran
from fp8_lightning.model import GPT
from fp8_lightning.tokenizer import get_tokenizer

from tests.helpers import GPU_B, GPU_SMALL, GPU_T

pytestmark = pytest.mark.gpu

SMALL, B, T = GPU_SMALL, GPU_B, GPU_T


@pytest.fixture(scope="module")
def batch():
    """One batch of real text (every step trains on it: the curve depends on the state alone)."""
    ids = torch.tensor(get_tokenizer("gpt2").encode(EMBEDDED_CORPUS.read_text()[:20_000]))
    return ids[: B * (T + 1)].view(B, T + 1)


def set_up(seed, path=None):
    """A fresh Fabric run; with ``path``, loaded from it before ``fabric.setup`` (the plugin
    applies its FP8 state at set-up)."""
    plugin = FabricFP8Precision(recipe={"name": "delayed", "amax_history_len": 16})
    fabric = L.Fabric(accelerator="cuda", devices=1, plugins=[plugin])
    torch.manual_seed(seed)
    model = GPT(GPTConfig.from_name("gpt2", **SMALL), backend="te")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    if path is not None:
        fabric.load(path, {"model": model, "optimizer": optimizer, "fp8": plugin})
    model, optimizer = fabric.setup(model, optimizer)
    guard = FabricNaNGuard(fabric, model, optimizer, check_every=5)
    state = {"model": model, "optimizer": optimizer, "fp8": plugin, "guard": guard}
    return fabric, plugin, model, optimizer, guard, state


def train(fabric, model, optimizer, guard, batch, steps):
    losses = []
    batch = fabric.to_device(batch.long())
    for _ in range(steps):
        loss = model(batch[:, :-1], batch[:, 1:])
        fabric.backward(loss)
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        guard.before_optimizer_step(loss, norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        guard.after_optimizer_step()
        losses.append(loss.detach())
    guard.end()
    return [float(v) for v in losses]


def test_fabric_trains_fp8_and_resumes_the_scaling_state(tmp_path, batch):
    fabric, plugin, model, optimizer, guard, state = set_up(seed=0)
    losses = train(fabric, model, optimizer, guard, batch, 20)
    assert plugin.fp8_active and plugin.effective_precision == "fp8-delayed", plugin.reason
    assert fp8_modules_ran(model.module), "no TE module ran FP8 in a Fabric training forward"
    assert losses[-1] < losses[0] - 1.0 and not guard.events, (losses, guard.events)

    model.eval()  # an evaluation forward runs BF16 (fp8_eval=False)
    with torch.no_grad():
        model(fabric.to_device(batch[:2, :-1].long()))
    assert not fp8_modules_ran(model.module)
    model.train()

    path = tmp_path / "fabric.ckpt"
    fabric.save(path, state)
    ckpt = torch.load(path, weights_only=True)  # no pickle anywhere
    scaling = ckpt["fp8"]["scaling"]
    assert scaling and all(v["amax_history_fwd"].abs().sum() > 0 for v in scaling.values())
    assert all(v.numel() == 0 for k, v in ckpt["model"].items() if k.endswith("_extra_state"))
    straight = train(fabric, model, optimizer, guard, batch, 5)

    for before_setup in (False, True):
        if before_setup:
            fabric2, plugin2, model2, optimizer2, guard2, _ = set_up(seed=1, path=path)
        else:
            fabric2, plugin2, model2, optimizer2, guard2, state2 = set_up(seed=1)
            fabric2.load(path, state2)
        assert plugin2.fp8_active and plugin2.scaling_restored == len(scaling), before_setup
        restored = export_fp8_scaling(model2.module)
        assert all(torch.equal(restored[name][key], saved[key])
                   for name, saved in scaling.items() for key in saved if key != "num_gemms")
        resumed = train(fabric2, model2, optimizer2, guard2, batch, 5)
        assert fp8_modules_ran(model2.module)
        for a, b in zip(straight, resumed):
            assert abs(a - b) < 1e-2, (before_setup, straight, resumed)


def test_the_fabric_example_replays_its_blocks_as_cuda_graphs_and_trains_as_eager(tmp_path,
                                                                                    capsys):
    """examples/fabric_train.py on one GPU: the TE blocks captured as one CUDA graph under the
    plugin's FP8 context (as fit's step), and the loss curve that of the eager blocks."""
    example = importlib.import_module("examples.fabric_train")
    args = ["--model", "gpt2", "--n_layer", "4", "--batch_size", "8", "--seq_len", "256",
            "--steps", "20", "--log_every", "5", "--save_every", "100", "--fresh",
            "--corpus_chars", "300000", "--accelerator", "gpu"]
    graphed = example.main(args + ["--ckpt", str(tmp_path / "graphs.ckpt")])
    assert "CUDA graphs: the blocks as one" in capsys.readouterr().out
    eager = example.main(args + ["--ckpt", str(tmp_path / "eager.ckpt"), "--no_cuda_graphs"])
    assert "CUDA graphs: off (--no_cuda_graphs)" in capsys.readouterr().out
    assert graphed["plugin"].fp8_active and eager["plugin"].fp8_active
    graphs = graphed["graphs"]  # captured under FP8 for (8, 256) and replaying
    assert graphs.active and graphs.key == ((8, 256), True) and len(graphs.units) == 1
    assert eager["graphs"] is None
    worst = max(abs(a - b) / b for a, b in zip(graphed["losses"], eager["losses"]))
    print(f"\n[Fabric graphs vs eager] losses {graphed['losses']} vs {eager['losses']}, worst "
          f"relative gap {worst:.4f}")
    assert len(graphed["losses"]) == 4 and graphed["losses"][-1] < graphed["losses"][0]
    assert worst < 0.02
