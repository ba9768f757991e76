import logging
import os

import lightning as L
import pytest
import torch

from fp8_lightning.config import ConfigError, GPTConfig
from fp8_lightning.fp8 import (FP8Precision, ModelConverter, bf16_module_names,
                               build_recipe_config, get_engine)
from fp8_lightning.fp8.recipes import describe
from fp8_lightning.model import GPT


def test_recipe_defaults_per_recipe():
    assert build_recipe_config("delayed") == {
        "recipe": "delayed", "fp8_format": "hybrid", "margin": 0, "amax_history_len": 1024,
        "amax_compute_algo": "max", "reduce_amax": True, "fp8_dpa": False}
    assert build_recipe_config("current") == {"recipe": "current", "fp8_format": "hybrid",
                                              "fp8_dpa": False}
    assert build_recipe_config("block")["fp8_format"] == "e4m3"


@pytest.mark.parametrize("recipe, fields, message", [
    ("delayd", {}, "recipe='delayd'; valid: delayed, current, block, mxfp8"),
    ("delayed", {"interval": 1}, "interval: removed in TransformerEngine 2.x.*valid fields"),
    ("delayed", {"amax_histroy_len": 16}, "amax_histroy_len is not a field of recipe='delayed'"),
    ("current", {"margin": 1}, "margin is not a field of recipe='current'; valid: fp8_format"),
    ("block", {"fp8_dpa": True}, "fp8_dpa is not a field of recipe='block'"),
    ("delayed", {"fp8_format": "e5m2"}, "fp8_format='e5m2'; valid: hybrid, e4m3 .E5M2-only"),
    ("block", {"fp8_format": "hybrid"}, "recipe='block'; valid: e4m3"),
    ("delayed", {"amax_compute_algo": "mean"}, "amax_compute_algo='mean'; valid: max, most_recent"),
    ("delayed", {"amax_history_len": 0}, "amax_history_len=0 must be an integer >= 1"),
])
def test_recipe_errors_name_the_valid_choices(recipe, fields, message):
    with pytest.raises(ConfigError, match=message):
        build_recipe_config(recipe, **fields)


def test_plugin_argument_errors():
    with pytest.raises(ConfigError, match="weights='fp16'; valid: bf16-mixed, bf16-true"):
        FP8Precision(weights="fp16")
    with pytest.raises(ConfigError, match="bf16_first_layers=-1"):
        FP8Precision(bf16_first_layers=-1)
    with pytest.raises(ConfigError, match="recipe=.* has no name; valid: a mapping with name"):
        FP8Precision(recipe={"amax_history_len": 16})
    with pytest.raises(ConfigError, match="amax_history_len is not a field of recipe='block'"):
        FP8Precision(recipe={"name": "block", "amax_history_len": 16})
    with pytest.raises(ConfigError, match="converter='graphs'; valid: a ModelConverter"):
        FP8Precision(converter="graphs")
    with pytest.raises(TypeError):
        FP8Precision(interval=1)  # the old DelayedScaling keyword is not an argument
    with pytest.raises(TypeError):
        FP8Precision(amax_history_len=16)  # a field of the recipe: recipe={"name": ..., ...}


def test_the_recipe_is_a_name_or_a_mapping_of_its_name_and_own_fields():
    assert FP8Precision(recipe="current").recipe_config == build_recipe_config("current")
    plugin = FP8Precision(recipe={"name": "delayed", "amax_history_len": 16, "margin": None})
    assert plugin.recipe_config == build_recipe_config("delayed", amax_history_len=16)
    assert FP8Precision(recipe={"name": "tensorwise"}).engine.name == "torchao"
    auto = FP8Precision(engine="auto", recipe={"amax_history_len": 16})  # auto picks the recipe
    auto.apply_auto_choice("current", "measured")
    assert auto.recipe_config == build_recipe_config("current")  # current has no amax history
    auto = FP8Precision(engine="auto", recipe={"amax_history_len": 16})
    auto.apply_auto_choice("delayed", "measured")
    assert auto.recipe_config == build_recipe_config("delayed", amax_history_len=16)


def test_the_plugin_takes_a_handful_of_options_each_typed():
    """The FP8 core only: recipe, engine, weights, evaluation and layer policy, fallback, and one
    converter for what else makes a model fast (fp8_lightning.Speedups)."""
    import inspect

    params = inspect.signature(FP8Precision).parameters
    assert len(params) <= 10, list(params)
    assert all(p.annotation is not inspect.Parameter.empty for p in params.values())


def test_layer_policy_keeps_lm_head_and_edge_blocks_bf16():
    model = GPT(GPTConfig.from_name("tiny", n_layer=4))
    gemms = get_engine("torchao").gemm_modules(model)  # the PyTorch layers' GEMM modules
    keep = bf16_module_names(model, gemms, fp8_lm_head=False, bf16_first_layers=1,
                             bf16_last_layers=1)
    assert keep == {"blocks.0": "bf16_first_layers=1", "blocks.3": "bf16_last_layers=1",
                    "lm_head": "fp8_lm_head=false"}
    assert bf16_module_names(model, gemms, fp8_lm_head=True, bf16_first_layers=0,
                             bf16_last_layers=0) == {}


FALLBACKS = {"bf16": ("bf16-mixed", "BF16 on the CPU (it has BF16 instructions)"),
             "fp32": ("32-true", "FP32 on the CPU: it has no BF16 instructions")}


@pytest.fixture(params=sorted(FALLBACKS))
def fallback(request, monkeypatch):
    """Each fallback this hardware check can choose (BF16 where the CPU or GPU has it, FP32 on a
    CPU without BF16 instructions), whichever machine runs the test."""
    import fp8_lightning.fp8.plugin as plugin

    monkeypatch.setattr(plugin, "fallback_precision", lambda: FALLBACKS[request.param])
    return request.param


def test_fallback_without_te_or_gpu_says_why(caplog, fallback):
    plugin = FP8Precision()
    with caplog.at_level(logging.WARNING):
        plugin.convert_module(GPT(GPTConfig.from_name("tiny")))
    assert not plugin.fp8_active and plugin.effective_precision == fallback
    assert plugin.status.startswith(f"{fallback.upper()} (fallback: ")
    assert FALLBACKS[fallback][1] in plugin.status  # the reason for the precision too
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "FP8 is not available:" in warnings[0].getMessage()
    assert f"Running {FALLBACKS[fallback][1]}" in warnings[0].getMessage()
    assert plugin.history[-1]["event"] == "unavailable"


def test_the_real_fallback_matches_this_cpu():
    """This machine's answer agrees with its instruction set (the CI CPUs have no BF16)."""
    from fp8_lightning.te_availability import cpu_has_native_bf16, fallback_precision

    if torch.cuda.is_available():
        pytest.skip("a GPU machine")
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    has = any(f in flags for f in ("avx512_bf16", "amx_bf16", "bf16"))
    assert cpu_has_native_bf16() == has
    assert fallback_precision()[0] == ("bf16-mixed" if has else "32-true")


def test_on_unavailable_error_stops():
    with pytest.raises(RuntimeError, match="FP8 is not available: .*on_unavailable=error"):
        FP8Precision(on_unavailable="error").convert_module(GPT(GPTConfig.from_name("tiny")))


def test_fallback_context_autocasts_only_in_bf16_and_leaves_default_dtype(fallback):
    plugin = FP8Precision()
    model = GPT(GPTConfig.from_name("tiny"))
    plugin.convert_module(model)
    with plugin.train_step_context():
        out = model.lm_head(torch.randn(2, 64))
    assert out.dtype == (torch.bfloat16 if fallback == "bf16" else torch.float32)
    assert torch.get_default_dtype() == torch.float32
    assert model.lm_head.weight.dtype == torch.float32  # fp32 master weights


def test_bf16_true_casts_the_weights_where_bf16_is_native(fallback):
    plugin = FP8Precision(weights="bf16-true")
    model = plugin.convert_module(GPT(GPTConfig.from_name("tiny")))
    assert model.lm_head.weight.dtype == (torch.bfloat16 if fallback == "bf16" else torch.float32)


def test_state_dict_round_trip_and_switch_history(fallback):
    a = FP8Precision(recipe="current", bf16_last_layers=1)
    a.convert_module(GPT(GPTConfig.from_name("tiny")))
    # The switch without FP8 available: disable is a no-op, enable refuses.
    a.disable_fp8("test", step=3)
    assert a.enable_fp8() is False
    state = a.state_dict()
    torch.save(state, "/dev/null")  # plain types only
    assert state["recipe"] == {"recipe": "current", "fp8_format": "hybrid", "fp8_dpa": False}
    assert state["effective_precision"] == fallback and state["fp8_active"] is False
    b = FP8Precision(recipe="current")
    b.load_state_dict(state)
    assert [h["event"] for h in b.history] == ["unavailable"]


def test_switch_records_history_when_fp8_was_active():
    plugin = FP8Precision()
    plugin.fp8_available = plugin.fp8_active = True  # as after a successful setup on a GPU
    plugin.disable_fp8("loss was NaN", step=40)
    assert plugin.status == "BF16 (fallback: loss was NaN)"
    assert plugin.enable_fp8(reset_scaling=False, step=90) is True
    assert plugin.status == "FP8 delayed"
    assert [(h["event"], h["step"]) for h in plugin.history] == [("disabled", 40), ("enabled", 90)]
    restored = FP8Precision()
    restored.fp8_active = True
    restored.load_state_dict({**plugin.state_dict(), "fp8_active": False,
                              "history": plugin.history[:1]})
    assert not restored.fp8_active and "loss was NaN" in restored.reason


def test_plugin_trains_the_torch_backend_with_the_trainer(tmp_path):
    from fp8_lightning.module import GPTLightningModule

    L.seed_everything(0)
    # (a small vocabulary: GPT-2's 50k one would be most of each CPU step)
    module = GPTLightningModule(config=GPTConfig.from_name("tiny", n_layer=1, vocab_size=1000),
                                backend="torch", learning_rate=3e-3, warmup_steps=2)
    data = torch.randint(0, 1000, (64, 33))
    trainer = L.Trainer(max_steps=8, plugins=[FP8Precision()], accelerator="cpu",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=tmp_path, limit_val_batches=0)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    assert trainer.global_step == 8
    assert trainer.precision_plugin.effective_precision in ("bf16", "fp32")  # this machine's
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


def test_on_unavailable_error_is_one_cli_error_line(tmp_path, capsys, small_vocab):
    from pathlib import Path

    from fp8_lightning.cli import main

    config = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
    with pytest.raises(SystemExit) as exit:
        main(["fit", "--config", str(config), *small_vocab, "--trainer.max_steps", "1",
              "--trainer.default_root_dir", str(tmp_path),
              "--trainer.plugins.init_args.on_unavailable", "error"])
    err = capsys.readouterr().err
    assert exit.value.code == 2
    assert "error: FP8 is not available: " in err and "on_unavailable=error, stopping." in err
    assert "Traceback" not in err


class _Recorder(ModelConverter):
    """A converter that writes down the hooks the plugin calls, in order."""

    def __init__(self):
        self.calls = []

    def engine_options(self, model, engine):
        self.calls.append(("engine_options", engine))
        return {}

    def convert(self, model, *, engine, fp8, weights, swapped):
        self.calls.append(("convert", fp8))

    def context(self):
        self.calls.append("context")
        return super().context()

    def training_forward(self, step_start):
        self.calls.append(("training_forward", step_start))
        return super().training_forward(step_start)

    def before_backward(self):
        self.calls.append("before_backward")

    def teardown(self):
        self.calls.append("teardown")


def test_the_plugin_applies_its_converter_at_set_up_and_around_each_forward_and_backward(tmp_path):
    """A CPU runs BF16 (the fallback): the converter is told so at set-up, then opens its
    contexts around the training forward and backward and the validation forward, and is torn
    down with the run."""
    from fp8_lightning.module import GPTLightningModule

    converter = _Recorder()
    module = GPTLightningModule(config=GPTConfig.from_name("tiny", n_layer=1, vocab_size=1000),
                                backend="torch", compile=False)
    data = torch.utils.data.DataLoader(torch.randint(0, 1000, (8, 17)), batch_size=8)
    trainer = L.Trainer(max_steps=1, limit_val_batches=1, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path,
                        plugins=[FP8Precision(recipe="tensorwise", converter=converter)])
    trainer.fit(module, data, data)
    calls = converter.calls
    assert calls[0] == ("convert", False)  # no FP8 on a CPU: never asked for engine options
    train = calls.index(("training_forward", True))
    assert "context" in calls[train:] and "before_backward" in calls[train:]
    assert calls.count("context") >= 3  # the training forward, its backward, a validation
    assert calls[-1] == "teardown"


def test_the_log_names_the_recipe_fields_set_away_from_their_defaults():
    assert describe(build_recipe_config("delayed")) == "delayed"
    recent = build_recipe_config("delayed", amax_history_len=1, amax_compute_algo="most_recent")
    assert describe(recent) == "delayed (amax_history_len=1, amax_compute_algo=most_recent)"
