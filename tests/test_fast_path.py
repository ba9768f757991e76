"""The training step's fast path, decided before the first step: what compiles and what replays
as CUDA graphs, and why (the replays themselves need a GPU: tests/test_gpu_fast_path.py and
tests/test_gpu_engines.py run them)."""

import functools

import lightning as L
import pytest
import torch

from fp8_lightning import fast_path as fast_path_lib
from fp8_lightning import fast_path_runner
from fp8_lightning.config import GPTConfig
from fp8_lightning.fast_path import FastPath, plan_compile, plan_graphs
from fp8_lightning.graphs import graphs_status
from fp8_lightning.module import GPTLightningModule

COMPILED = FastPath(True, "torch.compile works here")


class FP8Stats:  # graphs_status knows the callback by its class name (no TE import needed)
    pass


class FaultInjection:  # (by class name, as FP8Stats)
    pass


def test_compile_is_on_on_a_gpu_off_on_a_cpu_and_te_under_fsdp2_compiles_only_the_loss(monkeypatch):
    # (this machine may lack Triton, which a GPU's compile needs: the GPU's answer stands in)
    monkeypatch.setattr(fast_path_lib, "compile_status", lambda device: (True, "torch.compile works here"))
    assert plan_compile(None, "cuda", "te") == FastPath(True, "torch.compile works here")
    cpu = plan_compile(None, "cpu", "te")
    assert not cpu.compile and "costs a short CPU run more than it saves" in cpu.compile_why
    assert plan_compile(True, "cpu", "te").compile  # asked for: compiled
    fsdp = plan_compile(None, "cuda", "te", sharded=True)
    assert fsdp.compile and not fsdp.regions and "uncompiled in the step's CUDA graph" in fsdp.compile_why
    assert plan_compile(True, "cuda", "te", sharded=True).regions  # asked for: regions too
    assert not plan_compile(False, "cuda", "te").compile


@pytest.mark.parametrize("sharded", [False, True])
def test_the_pytorch_backend_compiles_each_block_before_fsdp2_shards_it(monkeypatch, sharded):
    monkeypatch.setattr(fast_path_lib, "compile_status", lambda device: (True, "torch.compile works here"))
    for wanted in (None, True):
        path = plan_compile(wanted, "cuda", "torch", sharded=sharded)
        assert path.compile and path.per_block == sharded
    assert not plan_compile(None, "cuda", "te", sharded=sharded).per_block  # TE's own layout


def test_compile_asked_for_where_it_cannot_run_trains_eagerly_and_says_why(monkeypatch):
    monkeypatch.setattr(fast_path_lib, "compile_status", lambda device: (False, "no Triton"))
    path = plan_compile(True, "cuda", "te")
    assert not path.compile and path.compile_why == "model.compile=true but no Triton; training eagerly"


@pytest.mark.parametrize("where, graphs", [
    (dict(backend="te"), "blocks"),  # one GPU: the block stack, one graph
    (dict(backend="te", world_size=2), "per-block"),  # DDP: the all-reduce between replays
    (dict(backend="torch", runs_float8=True), "inductor"),  # torchao float8, compiled
    # BF16 under DDP: each block compiled, then captured; the all-reduce between replays
    (dict(backend="torch", world_size=2), "per-block"),
    # TE under FSDP2, on several GPUs or one: the whole step, FSDP2's collectives inside it
    (dict(backend="te", world_size=2, sharded=True), "step"),
    (dict(backend="te", sharded=True), "step"),
    (dict(backend="te", sharded=True, activation_checkpointing="mlp"), "step"),  # recompute in it
])
def test_graphs_replay_where_they_were_measured_to_win(where, graphs):
    path = plan_graphs(COMPILED, None, device_type="cuda", **where)
    assert path.graphs == graphs and path.graphs_decided
    assert path.compile and path.compile_why == COMPILED.compile_why  # the rest of the plan kept


@pytest.mark.parametrize("wanted, where, reason", [
    (None, dict(device_type="cpu"), "CUDA graphs need a GPU"),
    (None, dict(backend="torch", world_size=2, sharded=True), "for this package's GPT on TE"),
    (None, dict(world_size=2, sharded=True, callbacks=[FP8Stats()]), "FP8Stats"),
    # what a capture of the whole step under FSDP2 cannot hold, or has no memory for
    (None, dict(world_size=2, sharded=True, activation_checkpointing="full"),
     "full activation checkpointing saves the CUDA RNG state"),
    (None, dict(world_size=2, sharded=True, callbacks=[FaultInjection()]),
     "FaultInjection's hooks on the embedding run in Python"),
    (None, dict(world_size=2, sharded=True, step_graph_fits=False),
     "the memory estimate says does not fit"),
    (None, dict(callbacks=[FP8Stats()]), "FP8Stats"),
    (None, dict(activation_checkpointing="full"), "activation checkpointing"),
    (None, dict(backend="torch"), "BF16 on the PyTorch backend is compiled without them"),
    (None, dict(backend="torch", runs_float8=True, world_size=2), "torchao float8 under DDP"),
    (None, dict(backend="torch", world_size=2, accumulate_grad_batches=2), "gradient accumulation"),
    (None, dict(backend="torch", world_size=2, path=FastPath(False, "off")), "compile, which is off"),
    (None, dict(backend="torch", runs_float8=True, accumulate_grad_batches=2), "gradient accumulation"),
    (True, dict(backend="torch", path=FastPath(False, "off")), "model.cuda_graphs=true but the "
     "PyTorch backend replays CUDA graphs through torch.compile, which is off"),
    (False, dict(), "model.cuda_graphs: false"),
])
def test_graphs_stay_off_elsewhere_and_say_why(wanted, where, reason):
    where = {"device_type": "cuda", "backend": "te", **where}
    path = plan_graphs(where.pop("path", COMPILED), wanted, **where)
    assert path.graphs is None and reason in path.graphs_why


def test_bf16_on_the_pytorch_backend_replays_graphs_when_asked():
    assert plan_graphs(COMPILED, True, device_type="cuda", backend="torch").graphs == "inductor"


def test_a_failed_compilation_takes_inductors_graphs_with_it_and_keeps_tes():
    inductor = plan_graphs(COMPILED, None, device_type="cuda", backend="torch", runs_float8=True)
    eager = inductor.without_compile("torch.compile failed (RuntimeError: no compiler)")
    assert not eager.compile and eager.graphs is None and "no compiler" in eager.graphs_why
    blocks = plan_graphs(COMPILED, None, device_type="cuda", backend="te").without_compile("x")
    assert blocks.graphs == "blocks"  # TE's block graphs do not go through torch.compile


def test_fit_decides_the_graphs_when_training_starts_and_the_step_only_follows(caplog):
    """The plan is whole before the first training step; a bare ``loss()`` call (no fit, no
    bench) decides nothing and replays nothing."""
    module = GPTLightningModule(GPTConfig(name="tiny", vocab_size=512), backend="torch")
    module.configure_model()
    assert module.fast_path.compile is False and not module.fast_path.graphs_decided
    module.loss(torch.randint(0, 512, (2, 17)))[0].backward()
    assert not module.fast_path.graphs_decided
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)
    with caplog.at_level("INFO"):
        trainer.fit(module, torch.utils.data.DataLoader(torch.randint(0, 512, (4, 17)), batch_size=2))
    assert module.fast_path.graphs is None and module.fast_path.graphs_why == "CUDA graphs need a GPU"
    assert "CUDA graphs: off (CUDA graphs need a GPU)" in caplog.text


@pytest.mark.parametrize("graphs, compiled", [
    ("inductor", "the whole model and its loss, one graph, replayed as CUDA graphs"),
    ("per-block", "each block and the loss"),
])
def test_the_pytorch_backend_is_compiled_for_its_graphs_when_they_are_planned(monkeypatch, graphs,
                                                                               compiled):
    """Compiling for the graphs is part of planning them (lazily: nothing compiles until the
    first call), not of the training step."""
    module = GPTLightningModule(GPTConfig(name="tiny", vocab_size=512, n_layer=2),
                                backend="torch", compile=True)
    module.configure_model()
    assert module.compiled == "the whole model and its loss, one graph"
    monkeypatch.setattr(fast_path_runner, "plan_graphs",
                        lambda path, *a, **k: FastPath(True, "x", graphs=graphs, graphs_why="y"))
    module.plan_graphs()
    assert module.compiled == compiled and module.fast_path.graphs == graphs
    per_block = all("residual" in block.__dict__ for block in module.model.blocks)
    assert per_block == (graphs == "per-block")
    assert (module.model._compiled_call_impl is None) == (graphs == "per-block")


# ------------------------------------------------ a model this package did not build (Speedups)
def test_another_models_blocks_are_recorded_a_graph_each_under_the_same_rules(monkeypatch):
    from fp8_lightning.fast_path import plan_model_graphs

    monkeypatch.setattr(fast_path_lib, "te_primes_after_warmup", lambda: True)
    plan = functools.partial(plan_model_graphs, None, None, engine="te", blocks=4)
    one_gpu = plan(device_type="cuda", world_size=1)
    assert one_gpu.graphs == "recorded" and one_gpu.graphs_why == "one GPU"
    assert one_gpu.compile and one_gpu.per_block  # each block's capture compiled
    ddp = plan(device_type="cuda", world_size=2)
    # the rule DDP's blocks follow in this package's GPT too; compiled captures measured on one GPU
    assert ddp.graphs == "recorded" and ddp.graphs_why == "DDP, a graph per block"
    assert not ddp.compile and "several ranks" in ddp.compile_why
    assert plan_model_graphs(None, True, engine="te", blocks=4, device_type="cuda",
                             world_size=2).compile  # asked for
    assert plan(device_type="cpu", world_size=1).graphs_why == "CUDA graphs need a GPU"
    # a TE whose make_graphed_callables cannot prime a compiled capture: graphs, not compiled
    monkeypatch.setattr(fast_path_lib, "te_primes_after_warmup", lambda: False)
    old_te = plan(device_type="cuda", world_size=1)
    assert old_te.graphs == "recorded" and not old_te.compile and "post_warmup_hook" in old_te.compile_why


@pytest.mark.parametrize("args, where, reason", [
    ((None, None), dict(engine="torchao"), "the torchao engine's modules are not captured"),
    ((None, None), dict(blocks=0), "no repeated blocks (an nn.ModuleList) found"),
    ((True, None), dict(blocks=0), "cuda_graphs=true but no repeated blocks"),
    ((False, True), dict(), "cuda_graphs: false"),
])
def test_another_models_graphs_stay_off_elsewhere_and_say_why(args, where, reason):
    from fp8_lightning.fast_path import plan_model_graphs

    where = {"engine": "te", "blocks": 4, "device_type": "cuda", "world_size": 1, **where}
    path = plan_model_graphs(*args, **where)
    assert path.graphs is None and reason in path.graphs_why and not path.compile


def test_under_fsdp2_only_this_packages_gpt_captures_its_step():
    """FSDP2 frees and re-gathers a block's weights between steps: a block's own replay would
    read freed storage, so only a whole-step capture (this package's GPT on TE) holds it."""
    ok, why = graphs_status("cuda", 2, sharded=True, whole_step=False)
    assert not ok and why.startswith("FSDP2's hooks run in Python, outside a block's replay")
    assert graphs_status("cuda", 2, sharded=True)[0]
