import logging
import re
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import yaml
from _runs import small_vocab_fit

from fp8_lightning import flops
from fp8_lightning import logs
from fp8_lightning.callbacks import monitor as M
from fp8_lightning.config import GPTConfig
from fp8_lightning.fp8 import FP8Precision
from fp8_lightning.fp8.stats import (BF16_SUFFIX, FP8Stats, debug_config, default_stats,
                                     scaling_stats, tensor_stat_metrics)
from fp8_lightning.module import GPTLightningModule

# The console line, parsed the way a user's log scraper would.
LINE = re.compile(
    r"^step (?P<step>\d+) \| loss (?P<loss>\d+\.\d{4}|n/a) \| lr (?P<lr>\d\.\d{2}e[-+]\d{2}|n/a) \| "
    r"norm (?P<norm>\d+\.\d{3}|n/a) \| dt (?P<dt>\d+\.\d)ms \| tok/s (?P<tps>\d{1,3}(?:,\d{3})*) \| "
    r"mfu (?P<mfu>\d+\.\d%|n/a)(?: \| mfu_fp8 (?P<mfu_fp8>\d+\.\d%))? \| "
    r"(?P<tag>FP8 \w+|(?:BF16|FP32) \(fallback: .+\)|\S+)$")


# ----------------------------------------------------------------------------- the line
def test_line_format_fp8():
    line = M.format_line(250, 3.45678, 6e-4, 0.8231, 156.84, 334567.2, 0.41234, 0.20617,
                         "FP8 delayed")
    assert line == ("step 250 | loss 3.4568 | lr 6.00e-04 | norm 0.823 | dt 156.8ms | "
                    "tok/s 334,567 | mfu 41.2% | mfu_fp8 20.6% | FP8 delayed")
    m = LINE.match(line)
    assert m and m["tag"] == "FP8 delayed" and m["mfu"] == "41.2%" and m["mfu_fp8"] == "20.6%"


def test_line_format_bf16_fallback_and_cpu():
    line = M.format_line(10, 10.5, 1.1e-3, None, 2264.56, 452.2, None, None,
                         "BF16 (fallback: no CUDA GPU is visible)")
    assert line == ("step 10 | loss 10.5000 | lr 1.10e-03 | norm n/a | dt 2264.6ms | tok/s 452 | "
                    "mfu n/a | BF16 (fallback: no CUDA GPU is visible)")
    m = LINE.match(line)
    assert m and m["mfu"] == "n/a" and m["mfu_fp8"] is None
    assert m["tag"] == "BF16 (fallback: no CUDA GPU is visible)"


def test_precision_tag_text():
    plugin = FP8Precision(recipe="current")
    plugin.fp8_active = True
    assert plugin.tag == "FP8 current"
    plugin.disable_fp8("loss spike")
    assert plugin.tag == "BF16 (fallback: loss spike)"
    # The monitor asks the module; without one it falls back to the Trainer's precision.
    module = SimpleNamespace(precision_tag=lambda: plugin.tag)
    assert M.precision_tag(SimpleNamespace(precision="bf16-mixed"), module) == plugin.tag
    assert M.precision_tag(SimpleNamespace(precision="bf16-mixed"), object()) == "bf16-mixed"


# ----------------------------------------------------------------------------- MFU arithmetic
def test_flops_per_token_by_hand():
    # GPT-2 124M: per layer QKV 768*2304 + out 768*768 + MLP 2*768*3072 = 7,077,888; x12 = 84,934,656
    # plus the LM head 50304*768 = 38,633,472 -> 123,568,128 matmul params.
    gpt2 = GPTConfig(name="gpt2")
    assert flops.matmul_params(gpt2) == 123_568_128
    # 6 * 123,568,128 + 12 * 12 layers * 1024 * 768 = 741,408,768 + 113,246,208
    assert flops.flops_per_token(gpt2) == 854_654_976
    assert flops.flops_per_token(gpt2, seq_len=512) == 741_408_768 + 56_623_104
    # GPT-2 medium: 24 * (1024*3072 + 1024^2 + 2*1024*4096) + 50304*1024 = 353,501,184
    medium = GPTConfig(name="gpt2-medium")
    assert flops.flops_per_token(medium) == 6 * 353_501_184 + 12 * 24 * 1024 * 1024
    # Llama 3 8B: GQA QKV (32+2*8)*128 = 6144 wide, SwiGLU 3 matrices, vocab 128256 (x128 already)
    llama = GPTConfig(name="llama3-8b")
    per_layer = 4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336
    assert flops.matmul_params(llama) == 32 * per_layer + 128256 * 4096 == 7_504_658_432
    assert flops.flops_per_token(llama) == 6 * 7_504_658_432 + 12 * 32 * 8192 * 4096


@pytest.mark.parametrize("name,bf16,fp8", [
    ("NVIDIA H100 80GB HBM3", 989.4e12, 1978.9e12),
    ("NVIDIA H100 PCIe", 756.5e12, 1513e12),
    ("NVIDIA H100 NVL", 835.5e12, 1671e12),
    ("NVIDIA H200", 989.4e12, 1978.9e12),
    ("NVIDIA H200 NVL", 835.5e12, 1671e12),
    ("NVIDIA GH200 480GB", 989.4e12, 1978.9e12),
    ("NVIDIA A100-SXM4-80GB", 312e12, None),
    ("NVIDIA A100 80GB PCIe", 312e12, None),
    ("NVIDIA L40S", 362.05e12, 733e12),
    ("NVIDIA L4", 121e12, 242.5e12),
    ("NVIDIA RTX 6000 Ada Generation", 364.2e12, 728.5e12),
])
def test_peak_table_by_device_name(name, bf16, fp8):
    peak = flops.peak_for(name)
    assert peak is not None and peak.bf16 == bf16 and peak.fp8 == fp8


def test_unknown_device_has_no_peak_and_no_mfu():
    assert flops.peak_for("NVIDIA GeForce GTX 1080") is None
    assert flops.mfu(1e6, 1e9, None) is None


def test_mfu_by_hand():
    f = 854_654_976  # GPT-2 124M at T=1024
    h100 = flops.peak_for("NVIDIA H100 80GB HBM3")
    # 400,000 tok/s * 854,654,976 FLOP = 3.41862e14 FLOP/s
    assert flops.mfu(400_000, f, h100.bf16) == pytest.approx(3.418619904e14 / 989.4e12)
    assert flops.mfu(400_000, f, h100.bf16) == pytest.approx(0.345524, abs=1e-6)
    assert flops.mfu(400_000, f, h100.fp8) == pytest.approx(0.172753, abs=1e-6)
    h200 = flops.peak_for("NVIDIA H200")
    assert flops.mfu(250_000, f, h200.bf16) == pytest.approx(0.215953, abs=1e-6)
    a100 = flops.peak_for("NVIDIA A100-SXM4-40GB")
    assert flops.mfu(100_000, f, a100.bf16) == pytest.approx(0.273928, abs=1e-6)
    assert a100.fp8 is None and flops.mfu(100_000, f, a100.fp8) is None


# ----------------------------------------------------------------------------- a real fit
@pytest.fixture(scope="module")
def fit_run(tmp_path_factory):
    """The session's 10-step quickstart fit through the CLI (on a small vocabulary: nothing the
    monitor shows depends on the tokenizer)."""
    return small_vocab_fit(tmp_path_factory)


def tensorboard(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = run_dir.rglob("events.out.tfevents.*")
    acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: {e.step: e.value for e in acc.Scalars(t)} for t in tags["scalars"]}
    texts = {t: [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(t)]
             for t in tags["tensors"]}
    return scalars, texts


def console_lines(text):
    """Lines as a terminal shows them: tqdm's bar redraws (\\r, cursor moves) taken out."""
    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text).splitlines()


def test_console_lines_in_a_cpu_fit(fit_run):
    _, result = fit_run
    stdout = console_lines(result.stdout)
    lines = [l for l in stdout if LINE.match(l)]
    assert [int(LINE.match(l)["step"]) for l in lines] == [5, 10], result.stdout[-2000:]
    for line in lines:
        m = LINE.match(line)
        assert m["mfu"] == "n/a" and m["mfu_fp8"] is None  # CPU: no peak
        assert m["tag"].startswith(("BF16 (fallback: ", "FP32 (fallback: "))  # and it says why
        assert float(m["loss"]) > 0 and float(m["dt"]) > 0 and m["norm"] != "n/a"
    assert any(re.match(r"^step 10 \| val/loss \d+\.\d{4} \| val/ppl \d+", l) for l in stdout)
    assert any(l.startswith("sample (step 10): 'ROMEO:") for l in stdout)
    assert any(l.startswith("monitor: every 5 steps; CPU: no peak, MFU n/a") for l in stdout)


def test_tensorboard_scalars_after_a_short_fit(fit_run):
    out, result = fit_run
    scalars, texts = tensorboard(out)
    for tag in (logs.TRAIN_LOSS, logs.TRAIN_LOSS_MEAN, logs.VAL_LOSS, logs.VAL_PPL, logs.LR, logs.GRAD_NORM,
                logs.TOKENS_SEEN, logs.TOKENS_PER_SEC, logs.STEP_TIME_MS, logs.PAUSED, logs.FP8_ACTIVE,
                logs.FALLBACK_EVENTS, logs.HP_METRIC):
        assert tag in scalars, (tag, sorted(scalars))
    # the monitor logs on Lightning's own step axis: train/loss and tokens_seen line up
    assert set(scalars[logs.TOKENS_SEEN]) == set(scalars[logs.TRAIN_LOSS]) == {4, 9}
    assert scalars[logs.TOKENS_SEEN] == {4: 5 * 8 * 128, 9: 10 * 8 * 128}
    assert scalars[logs.FP8_ACTIVE] == {4: 0.0, 9: 0.0}
    # the console line's loss, logged as it was printed
    printed = [float(LINE.match(l)["loss"]) for l in console_lines(result.stdout) if LINE.match(l)]
    assert [round(scalars[logs.TRAIN_LOSS_MEAN][s], 4) for s in (4, 9)] == printed
    assert scalars[logs.PAUSED] == {4: 0.0, 9: 0.0}  # validation and checkpoints come after step 10
    assert scalars[logs.FALLBACK_EVENTS][9] == 1.0  # FP8 unavailable here
    assert scalars[logs.HP_METRIC][9] == pytest.approx(scalars[logs.VAL_LOSS][9])
    assert logs.MFU not in scalars and logs.PEAK_MEMORY not in scalars  # CPU: no peak, no CUDA
    assert texts[f"{logs.SAMPLES}/text_summary"][0].strip().startswith("ROMEO:")
    assert texts[f"{logs.PRECISION_TEXT}/text_summary"][0].startswith(("BF16 (fallback: ", "FP32 (fallback: "))
    assert "unavailable" in texts[f"{logs.FP8_EVENTS_TEXT}/text_summary"][0]
    config = texts[f"{logs.CONFIG_TEXT}/text_summary"][0]
    assert "| model.config.name | tiny |" in config and "| fp8.recipe | delayed |" in config
    assert "| model.learning_rate | 0.003 |" in config


# ----------------------------------------------------------------------------- in process
class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.randint(0, 50257, (33,), generator=torch.Generator().manual_seed(i))


def test_gradient_accumulation_and_fp8_stats_gate_on_cpu(tmp_path, caplog):
    monitor = M.TrainingMonitor(log_every=2, sample_prompt=None, console=False)
    stats = FP8Stats(every_n_steps=2)
    module = GPTLightningModule(config=GPTConfig(name="tiny", n_layer=1, block_size=32),
                                warmup_steps=1)
    trainer = L.Trainer(max_steps=4, accumulate_grad_batches=2, plugins=[FP8Precision()],
                        accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[monitor, stats], default_root_dir=tmp_path)
    with caplog.at_level(logging.WARNING):
        trainer.fit(module, torch.utils.data.DataLoader(Tokens(), batch_size=4))
    assert [int(LINE.match(l)["step"]) for l in monitor.lines] == [2, 4]
    assert all(10.0 < float(LINE.match(l)["loss"]) < 11.5 for l in monitor.lines)  # mean, not sum
    # 2 steps x 2 micro-batches x 4 sequences x 32 tokens per line window
    assert module.tokens_seen == 4 * 2 * 4 * 32
    assert "FP8 stats off: FP8 cannot run here" in caplog.text
    assert not stats.enabled and stats.logged_steps == []


def logged_fit(root, steps=6, logger="csv"):
    """A tiny in-process fit logged by CSVLogger only (``logger="tensorboard"``: by
    TensorBoardLogger only): lines every 2 steps, a validation with a text sample at step 4 and a
    checkpoint save then."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    monitor = M.TrainingMonitor(log_every=2, sample_prompt="The", sample_tokens=4, console=False)
    module = GPTLightningModule(config=GPTConfig(name="tiny", n_layer=1, block_size=32),
                                warmup_steps=1)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=4)
    trainer = L.Trainer(max_steps=steps, plugins=[FP8Precision()], accelerator="cpu",
                        logger={"csv": CSVLogger, "tensorboard": TensorBoardLogger}[logger](root),
                        log_every_n_steps=2, enable_progress_bar=False,
                        enable_model_summary=False, val_check_interval=4, limit_val_batches=1,
                        num_sanity_val_steps=0, callbacks=[monitor], default_root_dir=root)
    trainer.fit(module, loader, loader)
    return monitor, trainer


def test_csv_logger_keeps_text_in_text_jsonl_with_one_warning(tmp_path):
    import csv
    import json
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor, trainer = logged_fit(tmp_path)
    log_dir = tmp_path / "lightning_logs" / "version_0"
    said = [str(w.message) for w in caught if "no text support" in str(w.message)]
    assert said == [f"CSVLogger has no text support: text entries (samples, fp8/events, "
                    f"guard/events, run/config) go to {log_dir / logs.TEXT_FILE}"]
    entries = [json.loads(l) for l in (log_dir / logs.TEXT_FILE).read_text().splitlines()]
    tags = {e["tag"] for e in entries}
    assert {logs.SETUP_TEXT, logs.PRECISION_TEXT, logs.CONFIG_TEXT, logs.FP8_EVENTS_TEXT, logs.SAMPLES} <= tags
    assert "| model.config.name | tiny |" in next(e["text"] for e in entries if e["tag"] == logs.CONFIG_TEXT)
    assert next(e for e in entries if e["tag"] == logs.SAMPLES)["text"].strip().startswith("The")
    # the scalars are in metrics.csv, the console line's loss among them
    rows = list(csv.DictReader(open(log_dir / "metrics.csv")))
    means = [float(r[logs.TRAIN_LOSS_MEAN]) for r in rows if r.get(logs.TRAIN_LOSS_MEAN)]
    assert [f"{m:.4f}" for m in means] == [LINE.match(l)["loss"] for l in monitor.lines]
    paused = [float(r[logs.PAUSED]) for r in rows if r.get(logs.PAUSED)]
    assert paused == [0.0, 0.0, 1.0]  # steps 2, 4; the window of step 6 held the validation


class _NoText(L.pytorch.loggers.Logger):
    """A logger with scalars only and no directory."""

    name, version = "no_text", 0

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def test_log_text_uses_each_loggers_api_and_warns_about_the_rest(tmp_path, monkeypatch):
    import warnings

    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger

    calls = []
    wandb = WandbLogger.__new__(WandbLogger)  # (no wandb package here: only the API is called)
    wandb.log_text = lambda **kw: calls.append(("wandb", kw))

    class FakeMLflow(MLFlowLogger):
        run_id = "run1"
        experiment = SimpleNamespace(log_text=lambda *a: calls.append(("mlflow", a)))

        def __init__(self):
            pass

    tb = TensorBoardLogger(tmp_path, name="tb")
    trainer = SimpleNamespace(is_global_zero=True, global_step=7, fit_loop=None,
                              loggers=[tb, wandb, FakeMLflow(), _NoText()])
    monkeypatch.setattr(logs, "_TEXT_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logs.log_text(trainer, "samples", "hello")
        logs.log_text(trainer, "samples", "again")
    assert calls[0] == ("wandb", {"key": "samples", "columns": ["step", "text"],
                                  "data": [[7, "hello"]], "step": 7})
    assert calls[1] == ("mlflow", ("run1", "hello", "text/samples/step_00000007.md"))
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and said[0].startswith("_NoText has no text support and no log_dir")
    tb.experiment.flush()
    assert list(Path(tb.log_dir).glob("events.out.tfevents.*"))
    assert not (tmp_path / logs.TEXT_FILE).exists()
    trainer.is_global_zero = False  # other ranks log nothing
    logs.log_text(trainer, "samples", "rank 1")
    assert len(calls) == 4


# ----------------------------------------------------------------------------- FP8Stats pieces
def test_fp8_stats_debug_config_matches_fp8_layers_only():
    config = debug_config(50, ["activation", "gradient"], default_stats("delayed"))
    section = config["fp8_lightning_fp8_stats"]
    feature = section["transformer_engine"]["LogFp8TensorStats"]
    assert feature == {"enabled": True, "tensors": ["activation", "gradient"],
                       "stats": ["underflows%", "overflows%"], "freq": 50}
    pattern = re.compile(section["layers"]["layer_name_regex_pattern"])
    assert pattern.search("blocks.3.qkv") and pattern.search("blocks.3.mlp.fc2")
    assert not pattern.search("lm_head" + BF16_SUFFIX)
    assert not pattern.search("blocks.0.qkv" + BF16_SUFFIX + ".fc1")
    only = re.compile(debug_config(1, ["weight"], ["underflows%"], layers=r"blocks\.(0|11)\.")
                      ["fp8_lightning_fp8_stats"]["layers"]["layer_name_regex_pattern"])
    assert only.search("blocks.11.proj") and not only.search("blocks.1.proj")
    assert default_stats("current") == ["underflows%"]
    yaml.safe_load(yaml.safe_dump(config))  # what the callback writes


def test_fp8_stats_names_from_te():
    metrics = tensor_stat_metrics({"blocks.0.qkv_activation_underflows%": torch.tensor(0.25),
                                   "blocks.1.mlp.fc2_gradient_underflows%": 1.5,
                                   "blocks.0.qkv_gradient_underflows%": 0.5,
                                   "lm_head_weight_scale_inv_min": 0.125})
    assert metrics == {
        "fp8_underflows_pct/blocks.0.qkv.activation": 0.25,
        "fp8_underflows_pct/blocks.1.mlp.fc2.gradient": 1.5,
        "fp8_underflows_pct/blocks.0.qkv.gradient": 0.5,
        "fp8_scale_inv_min/lm_head.weight": 0.125,
        "fp8_underflows_pct/all_layers_max.activation": 0.25,
        "fp8_underflows_pct/all_layers_max.gradient": 1.5,
        "fp8_scale_inv_min/all_layers_max.weight": 0.125,
    }


def test_fp8_stats_amax_and_scale_from_fp8_meta():
    def meta(history, scale):
        return SimpleNamespace(amax_history=torch.tensor(history), scale=torch.tensor(scale))

    linear = SimpleNamespace(fp8_meta={  # one GEMM: fwd [input, weight, output], bwd [dgrad, -]
        "num_gemms": 1,
        "scaling_fwd": meta([[1.0, 0.5, 0.0], [3.0, 0.25, 0.0]], [100.0, 800.0, 1.0]),
        "scaling_bwd": meta([[1e-3, 0.0], [2e-3, 0.0]], [2e7, 1.0])})
    mlp = SimpleNamespace(fc1_weight=None, fp8_meta={
        "num_gemms": 2,
        "scaling_fwd": meta([[1, 2, 0, 3, 4, 0]], [10, 20, 1, 30, 40, 1]),
        "scaling_bwd": meta([[5, 0, 6, 0]], [50, 1, 60, 1])})
    not_fp8 = SimpleNamespace(fp8_meta={"fp8_checkpoint": False})
    stats = scaling_stats({"blocks.0.qkv": linear, "blocks.0.mlp": mlp, "lm_head": not_fp8})
    assert stats["fp8_amax/blocks.0.qkv.input"] == 3.0  # max over the history window
    assert stats["fp8_amax/blocks.0.qkv.weight"] == 0.5
    assert stats["fp8_scale/blocks.0.qkv.weight"] == 800.0
    assert stats["fp8_amax/blocks.0.qkv.grad_output"] == pytest.approx(2e-3)
    assert stats["fp8_scale/blocks.0.qkv.grad_output"] == 2e7
    assert stats["fp8_amax/blocks.0.mlp.fc2.input"] == 3.0
    assert stats["fp8_scale/blocks.0.mlp.fc2.weight"] == 40.0
    assert stats["fp8_amax/blocks.0.mlp.fc2.grad_output"] == 6.0
    assert len(stats) == 3 * 2 * 3  # 3 GEMMs x (amax, scale) x (input, weight, grad_output)


def test_fp8_stats_rejects_bad_arguments():
    from fp8_lightning.config import ConfigError

    with pytest.raises(ConfigError, match="every_n_steps=0"):
        FP8Stats(every_n_steps=0)
    with pytest.raises(ConfigError, match="tensors=\\['output'\\]"):
        FP8Stats(tensors=["output"])
