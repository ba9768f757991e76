"""The fast path ``"step"`` (TE under FSDP2, fp8_lightning/step_graph.py): the training step runs
a micro-batch's forward, in the precision plugin's autocast, and its backward itself; the plugin
leaves the autocast to it and Lightning's backward has nothing left to do. On the CPU the step
runs eagerly (capturing it needs a GPU: tests/test_gpu_fast_path.py replays it): what is checked here
is that Lightning's loop around it trains exactly as around its own backward."""

from dataclasses import replace

import lightning as L
import pytest
import torch

from fp8_lightning import fast_path_runner
from fp8_lightning.config import GPTConfig
from fp8_lightning.distributed import FSDP2Strategy
from fp8_lightning.fp8 import FP8Precision
from fp8_lightning.module import GPTLightningModule
from tests.helpers import VOCAB, Tokens


class Record(L.Callback):
    def __init__(self):
        self.losses, self.grads_kept = [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, module):
        self.grads_kept = [p.grad is not None for p in module.parameters()]
        self.weights = {n: p.full_tensor().detach().clone() for n, p in module.named_parameters()}


def fit(tmp_path, monkeypatch, step):
    if step:  # the plan a GPU would make for TE under FSDP2
        plan = fast_path_runner.plan_graphs
        monkeypatch.setattr(fast_path_runner, "plan_graphs", lambda *a, **k: replace(
            plan(*a, **k), graphs="step", graphs_why="TE under FSDP2"))
    L.seed_everything(0)
    module = GPTLightningModule(config=GPTConfig(name="tiny", n_layer=2, block_size=32,
                                                 vocab_size=VOCAB), warmup_steps=1)
    record, plugin = Record(), FP8Precision()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=FSDP2Strategy(), plugins=[plugin],
                        max_steps=3, accumulate_grad_batches=2, gradient_clip_val=1.0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[record], default_root_dir=tmp_path)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=2)
    trainer.fit(module, loader)
    monkeypatch.undo()
    return module, plugin, record


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        lightning = fit(tmp_path_factory.mktemp("own"), monkeypatch, step=False)
        step = fit(tmp_path_factory.mktemp("step"), monkeypatch, step=True)
    return lightning, step


def test_a_step_that_runs_its_own_backward_trains_as_lightnings_backward(runs):
    """Three optimizer steps of two accumulated micro-batches, clipped: the same losses and the
    same weights, exactly, whether Lightning's backward ran or the step's own."""
    (_, _, own), (module, plugin, step) = runs
    assert module.fast_path.graphs == "step" and len(step.losses) == 6
    assert step.losses == own.losses
    assert step.weights.keys() == own.weights.keys()
    for name, weight in own.weights.items():
        assert torch.equal(step.weights[name], weight), name


def test_the_step_opens_the_autocast_and_its_gradients_stay_allocated(runs):
    """Under the step path the plugin leaves the autocast to the step (a captured step must hold
    its exit); the gradients are zeroed in place after each optimizer step (a replay's
    reduce-scatters add into them), where Lightning's path drops them."""
    (_, own_plugin, own), (_, plugin, step) = runs
    assert plugin.step_owns_autocast and not own_plugin.step_owns_autocast
    assert all(step.grads_kept) and not any(own.grads_kept)


def test_the_captured_gradients_stay_the_parameters_gradients_through_a_validation(tmp_path):
    """Lightning drops every gradient before a validation; FSDP2's next (eager) backward would
    then give each parameter a new gradient while the graph's replays add into the captured
    ones. Before each step the captured tensors go back, zeroed (or holding what a gradient
    that replaced them held), so an eager backward adds into the memory the replays add into."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fp8_lightning.step_graph import StepGraph

    ours = not dist.is_initialized()  # (a fit before, in this process, leaves its own)
    if ours:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                                rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = torch.randn(3, 4)
        model(x).sum().backward()
        step = StepGraph(model)
        step.grads = [(p, p.grad) for p in model.parameters()]  # as a capture records them
        first = [g.full_tensor().clone() for _, g in step.grads]

        model.zero_grad(set_to_none=True)  # Lightning, before a validation
        step._keep_grads()
        assert all(p.grad is g and not g.full_tensor().any() for p, g in step.grads)
        model(x).sum().backward()  # the eager step after the validation
        assert all(p.grad is g for p, g in step.grads)
        assert all(torch.equal(g.full_tensor(), f) for (_, g), f in zip(step.grads, first))

        for p, _ in step.grads:  # a gradient put in their place: its values are kept
            p.grad = p.grad * 2
        step._keep_grads()
        assert all(p.grad is g for p, g in step.grads)
        assert all(torch.equal(g.full_tensor(), 2 * f) for (_, g), f in zip(step.grads, first))
        step.remove()
    finally:
        if ours:
            dist.destroy_process_group()


def test_a_freed_step_graph_is_reset_and_still_says_what_it_replayed():
    """At the end of a fit, or at exit for a run that never reached a teardown, the graph is
    reset (its NCCL work must not outlive the process group); ``replaying`` still names the
    key, until the graph is released or captured anew."""
    from fp8_lightning.step_graph import StepGraph

    class Graph:  # stands in for torch.cuda.CUDAGraph, which needs a GPU
        was_reset = False

        def reset(self):
            self.was_reset = True

    step, graph = StepGraph(torch.nn.Linear(2, 2)), Graph()
    step.key, step.graph = ((8, 1024), 1, True), graph
    assert step.replaying == ((8, 1024), 1, True)
    step.free()
    assert graph.was_reset and step.graph is None and step.replaying == ((8, 1024), 1, True)
    step.free()  # a second teardown: nothing left to free
    step.release()
    assert step.replaying is None
    # what a StepGraph registers with atexit: the same, for a run that never reached a teardown
    import weakref

    from fp8_lightning.step_graph import _free_at_exit

    step.key, step.graph = ((8, 1024), 1, True), Graph()
    graph = step.graph
    _free_at_exit(weakref.ref(step))
    assert graph.was_reset and step.graph is None
    step.remove()
    ref = weakref.ref(step)
    del step
    assert ref() is None
    _free_at_exit(ref)  # a graph object long gone: nothing to do
