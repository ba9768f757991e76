"""GPU tests of the monitoring: GPT-2 124M in FP8 with TrainingMonitor and FP8Stats.

`python -m pytest -m gpu tests/test_gpu_monitor.py -s` on the GPU machine (they skip without
CUDA/TE). They print a real console excerpt; the monitoring overhead is measured by
`scripts/overhead.py monitor`.
"""

import re

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from fp8_lightning import logs
from fp8_lightning.callbacks import monitor as M
from fp8_lightning.config import GPTConfig
from fp8_lightning.data.streaming import EMBEDDED_CORPUS
from fp8_lightning.fp8 import FP8Precision
from fp8_lightning.fp8.stats import AMAX, SCALE, FP8Stats
from fp8_lightning.module import GPTLightningModule
from fp8_lightning.tokenizer import get_tokenizer

pytestmark = pytest.mark.gpu

B, T = 8, 1024
LINE = re.compile(r"^step (?P<step>\d+) \| loss (?P<loss>[\d.]+) \| lr \S+ \| norm \S+ \| "
                  r"dt (?P<dt>[\d.]+)ms \| tok/s (?P<tps>[\d,]+) \| mfu (?P<mfu>[\d.]+)% \| "
                  r"mfu_fp8 (?P<mfu_fp8>[\d.]+)% \| (?P<tag>.+)$")


@pytest.fixture(scope="module")
def blocks():
    ids = torch.tensor(get_tokenizer("gpt2").encode(EMBEDDED_CORPUS.read_text()))
    n = ids.numel() // (T + 1)
    return ids[: n * (T + 1)].view(n, T + 1)


def fit(tmp_path, blocks, steps, callbacks, val=False, recipe="delayed"):
    L.seed_everything(0)
    module = GPTLightningModule(config=GPTConfig(name="gpt2"), learning_rate=6e-4,
                                warmup_steps=10, lr_decay_steps=max(steps, 100))
    train = torch.utils.data.DataLoader(blocks[:-16].repeat(4, 1), batch_size=B, shuffle=False,
                                        drop_last=True)
    loaders = [train]
    if val:
        loaders.append(torch.utils.data.DataLoader(blocks[-16:], batch_size=B))
    trainer = L.Trainer(
        max_steps=steps, plugins=[FP8Precision(recipe=recipe)], accelerator="gpu", devices=1,
        logger=TensorBoardLogger(tmp_path, name="", version=""), enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=10,
        num_sanity_val_steps=0, limit_val_batches=2 if val else 0,
        val_check_interval=steps if val else None, callbacks=callbacks, gradient_clip_val=1.0)
    trainer.fit(module, *loaders)
    return trainer


def scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    values = {t: [e.value for e in acc.Scalars(t)] for t in tags["scalars"]}
    texts = {t: [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(t)]
             for t in tags["tensors"]}
    return values, texts


def test_gpt2_fp8_run_shows_fp8_sane_mfu_and_fp8_stats(tmp_path, blocks, capsys):
    monitor = M.TrainingMonitor(log_every=10, sample_prompt="ROMEO:", sample_tokens=24)
    stats = FP8Stats(every_n_steps=30)
    trainer = fit(tmp_path, blocks, 60, [monitor, stats], val=True)
    assert trainer.precision_plugin.fp8_active
    lines = monitor.lines
    with capsys.disabled():
        print("\n[console excerpt, GPT-2 124M FP8, B=8 x T=1024]\n" + "\n".join(lines))
    assert len(lines) == 6
    parsed = [LINE.match(line) for line in lines]
    assert all(parsed), lines
    assert all(p["tag"] == "FP8 delayed" for p in parsed)
    steady = parsed[-1]  # the first window holds the warm-up
    assert 1.0 < float(steady["mfu"]) < 100.0 and 0.5 < float(steady["mfu_fp8"]) < 100.0
    assert float(steady["mfu_fp8"]) < float(steady["mfu"])  # the FP8 peak is the higher one

    values, texts = scalars(tmp_path)
    for tag in (logs.TOKENS_PER_SEC, logs.MFU, logs.MFU_FP8, logs.PEAK_MEMORY, logs.GRAD_NORM, logs.LR,
                logs.FP8_ACTIVE, logs.TRAIN_LOSS, logs.VAL_LOSS):
        assert tag in values, tag
    assert values[logs.FP8_ACTIVE] == [1.0] * 6
    # Validation's own peak (the reference 8B FP8 run crashed there): measured, and no surge.
    val_peak, train_peak = values[logs.VAL_PEAK_MEMORY][-1], max(values[logs.PEAK_MEMORY])
    assert 0 < val_peak <= 1.1 * train_peak, (val_peak, train_peak)
    out = capsys.readouterr().out
    shown = re.search(r"val/loss .* \| peak mem ([\d.]+) GiB \(training ([\d.]+) GiB\)", out)
    assert shown and abs(float(shown[1]) - val_peak) < 0.1, out[-2000:]
    assert re.search(r"memory: peak [\d.]+ GiB in training, [\d.]+ GiB in validation", out)
    assert f"{logs.SAMPLES}/text_summary" in texts and texts[f"{logs.SAMPLES}/text_summary"][0].strip()
    amax = {t: v for t, v in values.items() if t.startswith(AMAX + "/")}
    scale = {t: v for t, v in values.items() if t.startswith(SCALE + "/")}
    # 12 blocks x (qkv, proj, mlp.fc1, mlp.fc2) x (input, weight, grad_output); lm_head stays BF16
    assert len(amax) == len(scale) == 12 * 4 * 3, sorted(amax)[:8]
    assert not any("lm_head" in t for t in amax)
    assert all(len(v) == 2 for v in amax.values())  # steps 30, 60
    assert all(v[-1] > 0 for v in amax.values())
    under = {t: v for t, v in values.items() if t.startswith("fp8_underflows_pct/")}
    over = {t: v for t, v in values.items() if t.startswith("fp8_overflows_pct/")}
    assert "fp8_underflows_pct/blocks.0.qkv.activation" in under, sorted(values)[:20]
    assert "fp8_overflows_pct/blocks.11.mlp.fc2.gradient" in over, sorted(over)[:20]
    assert all(0.0 <= x <= 100.0 for v in under.values() for x in v)
    assert (stats.config_path.parent / "nvdlfw_inspect_logs").is_dir()
    with capsys.disabled():
        print("[fp8 stats at step 60] " + ", ".join(
            f"{t}={values[t][-1]:.4g}" for t in ("fp8_amax/blocks.0.qkv.input",
                                                 "fp8_scale/blocks.0.qkv.input",
                                                 "fp8_underflows_pct/blocks.0.qkv.activation",
                                                 "fp8_underflows_pct/all_layers_max.gradient",
                                                 "fp8_overflows_pct/all_layers_max.activation")))


def test_a_host_bound_runs_last_line_times_its_steps_as_the_others_do(tmp_path, blocks):
    """A loop the host holds back (50 ms of host work after each step, the GPU idle meanwhile):
    every line's dt, the last included, is a step's wall time. Timed on the host from the
    previous line's printing, the last line (printed at the end, without the one-step lag of
    the others) showed a fraction of a step (dt 3.4 ms, MFU 1581% on the 8B cut to 2 layers
    under FSDP2)."""
    import time

    class HostWork(L.Callback):  # after the monitor's hook: the GPU finishes the step meanwhile
        def on_train_batch_end(self, *args):
            time.sleep(0.05)

    monitor = M.TrainingMonitor(log_every=1, sample_prompt=None)
    fit(tmp_path, blocks, 12, [monitor, HostWork()])
    dts = [float(LINE.match(line)["dt"]) for line in monitor.lines]
    print(f"\n[host-bound lines] dt ms: {dts}")
    middle = sorted(dts[2:-1])[len(dts[2:-1]) // 2]
    assert middle > 50 and 0.8 * middle < dts[-1] < 1.25 * middle, dts


def test_generate_from_an_fp8_checkpoint_on_te_and_on_cpu(tmp_path, blocks):
    from fp8_lightning.commands.generate import generate

    L.seed_everything(0)
    module = GPTLightningModule(config=GPTConfig(name="gpt2", n_layer=2, block_size=128),
                                learning_rate=1e-3, warmup_steps=2, lr_decay_steps=10)
    loader = torch.utils.data.DataLoader(blocks[:64, :129], batch_size=B)
    trainer = L.Trainer(max_steps=10, plugins=[FP8Precision()], accelerator="gpu", devices=1,
                        logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        limit_val_batches=0, enable_model_summary=False)
    trainer.fit(module, loader)
    assert trainer.precision_plugin.fp8_active
    ckpt = tmp_path / "fp8.ckpt"
    trainer.save_checkpoint(ckpt)
    te_text = generate(str(ckpt), prompt="ROMEO:", max_new_tokens=17, temperature=0,
                       backend="te", device="cuda")
    cpu_text = generate(str(ckpt), prompt="ROMEO:", max_new_tokens=17, temperature=0,
                        backend="torch", device="cpu")
    assert te_text.startswith("ROMEO:") and cpu_text.startswith("ROMEO:")
    assert len(te_text) > len("ROMEO:") and len(cpu_text) > len("ROMEO:")


def test_fp8_stats_with_current_scaling(tmp_path, blocks):
    stats = FP8Stats(every_n_steps=10)
    fit(tmp_path, blocks, 20, [stats], recipe="current")
    values, _ = scalars(tmp_path)
    assert "fp8_underflows_pct/blocks.0.mlp.fc1.activation" in values, sorted(values)[:20]
    assert not any(t.startswith(("fp8_overflows_pct/", AMAX + "/")) for t in values)
    assert stats.logged_steps == [10, 20]


def test_a_fit_that_fails_turns_fp8_stats_debug_off_for_the_next(tmp_path, blocks):
    """A fit that raises skips teardown: FP8Stats ends TE's debug API in on_exception, so the
    next fit of the process (a notebook's) is back on the CUDA graphs."""
    import nvdlfw_inspect.api as debug_api

    from fp8_lightning.graphs import te_debug_on

    class Fail(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 12:
                raise RuntimeError("a fault in the middle of the run")

    stats = FP8Stats(every_n_steps=5)
    with pytest.raises(RuntimeError, match="a fault in the middle"):
        fit(tmp_path, blocks, 20, [stats, Fail()])
    assert stats.logged_steps == [5, 10]  # it ran, debug on
    assert debug_api.DEBUG_MANAGER is None and not te_debug_on() and not stats.debug_active
    trainer = fit(tmp_path / "next", blocks, 3, [])
    assert trainer.lightning_module.fast_path.graphs == "blocks", trainer.lightning_module.fast_path
