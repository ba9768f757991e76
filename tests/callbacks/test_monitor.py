import logging
import re
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from fp8_lightning import logs
from fp8_lightning.callbacks import monitor as M
from fp8_lightning.config import GPTConfig
from fp8_lightning.fp8 import FP8Precision
from fp8_lightning.fp8.stats import FP8Stats
from fp8_lightning.module import GPTLightningModule
from tests._runs import small_vocab_fit
from tests.helpers import LINE, VOCAB, Tokens


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
    assert plugin.status == "FP8 current"
    plugin.disable_fp8("loss spike")
    assert plugin.status == "BF16 (fallback: loss spike)"
    # The monitor asks the module; without one it falls back to the Trainer's precision.
    module = SimpleNamespace(precision_tag=lambda: plugin.status)
    assert M.precision_tag(SimpleNamespace(precision="bf16-mixed"), module) == plugin.status
    assert M.precision_tag(SimpleNamespace(precision="bf16-mixed"), object()) == "bf16-mixed"


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


def test_the_sample_of_a_head_larger_than_its_tokenizer_decodes():
    """A Llama-sized head trained on GPT-2 tokens (the 8B config on the embedded corpus): the
    text sample draws only ids the GPT-2 tokenizer can decode."""
    from fp8_lightning.model import GPT

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=50400))
    with torch.no_grad():  # ids past GPT-2's 50,257 would win every greedy draw
        model.norm_f.bias.fill_(1.0)
        model.lm_head.weight[50257:] = 10.0
    monitor = M.TrainingMonitor(sample_prompt="The", sample_tokens=4, sample_temperature=0,
                                tokenizer="gpt2")
    text = monitor.sample(SimpleNamespace(datamodule=None),
                          SimpleNamespace(model=model, device=torch.device("cpu")))
    assert text.startswith("The") and len(text) > len("The")


def test_console_lines_in_a_cpu_fit(fit_run):
    _, result = fit_run
    stdout = console_lines(result.stdout)
    lines = [l for l in stdout if LINE.match(l)]
    assert [int(LINE.match(l)["step"]) for l in lines] == [5, 10], result.stdout[-2000:]
    for line in lines:
        m = LINE.match(line)
        assert m["mfu"] == "n/a" and m["mfu_fp8"] is None  # CPU: no peak
        assert m["tag"] in ("BF16 (fallback)", "FP32 (fallback)")  # short: the reason is said once
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
def test_gradient_accumulation_and_fp8_stats_gate_on_cpu(tmp_path, caplog):
    monitor = M.TrainingMonitor(log_every=2, sample_prompt=None, console=False)
    stats = FP8Stats(every_n_steps=2)
    module = GPTLightningModule(config=GPTConfig(name="tiny", n_layer=1, block_size=32,
                                                 vocab_size=VOCAB), warmup_steps=1)
    trainer = L.Trainer(max_steps=4, accumulate_grad_batches=2, plugins=[FP8Precision()],
                        accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[monitor, stats], default_root_dir=tmp_path)
    with caplog.at_level(logging.WARNING):
        trainer.fit(module, torch.utils.data.DataLoader(Tokens(), batch_size=4))
    assert [int(LINE.match(l)["step"]) for l in monitor.lines] == [2, 4]
    # about ln(VOCAB) = 6.24 at the start: the mean over the micro-batches, not their sum (12.5)
    assert all(5.5 < float(LINE.match(l)["loss"]) < 7.0 for l in monitor.lines)
    # 2 steps x 2 micro-batches x 4 sequences x 32 tokens per line window
    assert module.tokens_seen == 4 * 2 * 4 * 32
    assert "FP8 stats off: FP8 cannot run here" in caplog.text
    assert not stats.enabled and stats.logged_steps == []


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
def test_a_compiled_runs_first_step_says_it_is_compiling_until_it_ends(tmp_path, capsys,
                                                                        monkeypatch, compile):
    """While the first step of a compiled run compiles, a line every few seconds says so (and
    none after it); an eager run prints none."""
    from fp8_lightning import progress

    monkeypatch.setattr(progress, "EVERY_S", 0.2)
    monitor = M.TrainingMonitor(log_every=2, sample_prompt=None)
    module = GPTLightningModule(config=GPTConfig(name="tiny", n_layer=1, block_size=32,
                                                 vocab_size=VOCAB), warmup_steps=1,
                                compile=compile)
    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[monitor], default_root_dir=tmp_path)
    trainer.fit(module, torch.utils.data.DataLoader(Tokens(), batch_size=4))
    lines = capsys.readouterr().out.splitlines()
    ticks = [i for i, line in enumerate(lines) if line.startswith("first training step: ")]
    first = next(i for i, line in enumerate(lines) if line.startswith("step 2 |"))
    if compile:
        assert module.compiled and ticks, lines
        assert all(re.fullmatch(r"first training step: compiling, \d+s so far", lines[i])
                   for i in ticks) and max(ticks) < first, lines
    else:
        assert not ticks, lines
