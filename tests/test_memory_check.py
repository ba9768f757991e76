"""The memory check before a fit (fp8_lightning/memory_check.py) on a CPU: the GPU's free memory
is given, so that what runs on a GPU (the budget, the FSDP2 answers, the stop) is checked here;
tests/test_gpu_memory.py runs it on a GPU."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from fp8_lightning.config import ConfigError, GPTConfig
from fp8_lightning.memory import RunShape, estimate_memory
from fp8_lightning.memory_check import check_memory, is_gpu_fit

CONFIG = GPTConfig.from_name("tiny")
RUN = RunShape(batch_size=8, seq_len=128)


def checked(monkeypatch, run, budget, **kwargs):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(budget), int(budget)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a test GPU")
    strategy = SimpleNamespace(root_device=torch.device("cpu"), reshard_after_forward=True)
    trainer = SimpleNamespace(strategy=strategy, world_size=run.shards, num_nodes=1)
    return check_memory(trainer, CONFIG, run, backend="te", step_graph=True, **kwargs)


def test_a_run_that_fits_passes_and_one_that_does_not_stops_or_warns(monkeypatch):
    need = estimate_memory(CONFIG, RUN).total
    fits = checked(monkeypatch, RUN, need * 1.01)
    assert fits.problem is None and fits.fits_one_gpu is None and fits.step_graph_fits
    fits.enforce(True)
    short = checked(monkeypatch, RUN, need * 0.5)
    assert short.problem
    with pytest.raises(ConfigError, match=r"model\.memory_check: false runs it anyway"):
        short.enforce(True)
    with pytest.warns(UserWarning, match="running anyway"):
        short.enforce(False)


def test_under_fsdp2_it_answers_whether_one_gpu_and_the_step_graph_fit(monkeypatch):
    sharded = replace(RUN, shards=2)
    whole = estimate_memory(CONFIG, RUN).total
    graph = estimate_memory(CONFIG, replace(sharded, gradients_kept=True))
    roomy = checked(monkeypatch, sharded, max(whole, graph.total + graph.activations) * 1.01)
    assert roomy.fits_one_gpu and roomy.step_graph_fits and roomy.problem is None
    tight = checked(monkeypatch, sharded, estimate_memory(CONFIG, sharded).total * 1.0001)
    assert tight.fits_one_gpu is False and not tight.step_graph_fits


def test_only_a_fit_on_a_gpu_is_checked():
    def trainer(device, training):
        return SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)),
                               training=training)

    assert not is_gpu_fit(None)
    assert not is_gpu_fit(trainer("cpu", True))
    assert not is_gpu_fit(trainer("cuda", False))
    assert is_gpu_fit(trainer("cuda", True))
