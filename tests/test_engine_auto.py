"""``engine: auto``: the FP8 engine and recipe, or BF16, chosen by timing each candidate through
``fit``'s own step (the timings need a GPU: tests/test_gpu_engines.py; here the choice, what the
probe asks for, and the fallbacks)."""

import pytest

from fp8_lightning.config import ConfigError, GPTConfig
from fp8_lightning.engine_auto import BF16, candidates, choose, choose_engine
from fp8_lightning.fp8 import FP8Precision
from fp8_lightning.model import GPT
from fp8_lightning.module import GPTLightningModule

CONFIG = GPTConfig(name="tiny", n_layer=2, vocab_size=512)


def test_auto_takes_the_fastest_candidate_fp8_or_bf16():
    assert candidates("te")[0] == "fp8-delayed-te-attn" and BF16 in candidates("sdpa")
    recipe, figures = choose({"fp8-delayed": 30.0, "fp8-tensorwise": 28.5, "fp8-block": None,
                              BF16: 31.0})
    assert recipe == "tensorwise"
    assert figures == ("fp8-tensorwise 28.50 ms, fp8-delayed 30.00 ms, torch-compile 31.00 ms "
                       "(could not run: fp8-block)")
    assert choose({"fp8-delayed-te-attn": 41.0, BF16: 39.9})[0] is None  # BF16 won
    assert choose({"fp8-delayed": None})[0] is None


def test_the_probe_times_each_fp8_candidate_with_the_runs_layer_policy(monkeypatch):
    """Stubbed timings (real ones need a GPU: tests/test_gpu_engines.py): what the probe asks
    measure() for is what would train, the plugin's layer policy included."""
    import fp8_lightning.engine_auto as auto
    from fp8_lightning.fp8.policy import POLICY_FIELDS

    asked = {}

    def measure(variant, config, batch_size, seq_len, *, steps, warmup, fp8_args, **kwargs):
        asked[variant.name] = fp8_args
        return {"status": "ran", "ms_per_step": 1.0}

    monkeypatch.setattr(auto, "measure", measure)
    monkeypatch.setattr(auto, "skip_reason", lambda *args: None)
    plugin = FP8Precision(engine="auto", bf16_first_layers=1, fp8_layers="auto")
    policy = {key: getattr(plugin, key) for key in POLICY_FIELDS}
    timings = auto.probe(CONFIG, 2, 32, "sdpa", GPTLightningModule, policy=policy)
    assert set(timings) == set(asked) and asked[BF16] is None
    assert asked["fp8-tensorwise"] == dict(fp8_lm_head=False, bf16_first_layers=1,
                                           bf16_last_layers=0, fp8_layers="auto",
                                           recipe="tensorwise", on_unavailable="error")


def test_auto_measures_only_where_it_can_and_says_so():
    with pytest.raises(ConfigError, match="recipe='delayed' with engine='auto'"):
        FP8Precision(engine="auto", recipe="delayed")
    plugin = FP8Precision(engine="auto")
    assert plugin.auto
    backend = choose_engine(plugin, GPTLightningModule, CONFIG, 2, 32, "sdpa")  # no GPU here
    # (nothing measured)
    assert not plugin.auto and plugin.auto_figures == "no GPU: nothing to measure"
    assert backend == "te" and plugin.state_dict()["auto"] == plugin.auto_figures
    plugin = FP8Precision(engine="auto")
    plugin.auto_bf16 = "engine auto measured BF16 fastest (stub)"  # what a GPU probe can decide
    plugin.auto = False
    plugin.on_unavailable = "error"  # BF16 chosen by measurement is no failure
    plugin.convert_module(GPT(CONFIG))
    assert not plugin.fp8_active and "BF16 fastest" in plugin.reason


def test_auto_with_several_processes_takes_rank_zeros_choice():
    """Rank zero measures; every rank builds what it chose (here a broadcast that hands over
    rank zero's choice, as the strategy's does)."""
    plugin = FP8Precision(engine="auto")
    sent = []

    def broadcast(obj):
        sent.append(obj)
        return ("rowwise", "fp8-rowwise 1.00 ms, torch-compile 2.00 ms")  # rank zero's

    assert choose_engine(plugin, GPTLightningModule, CONFIG, 2, 32, "sdpa", broadcast) == "torch"
    assert sent == [("delayed", "no GPU: nothing to measure")]  # what this rank measured
    assert plugin.engine.name == "torchao" and plugin.recipe_config == {"recipe": "rowwise"}
