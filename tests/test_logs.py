"""What the monitor hands Lightning's loggers: scalars, text, and one warning where a logger
cannot keep text (``fp8_lightning/logs.py``)."""

from pathlib import Path
from types import SimpleNamespace

import lightning as L

from fp8_lightning import logs
from tests.helpers import LINE, logged_fit


class _NoText(L.pytorch.loggers.Logger):
    """A logger with scalars only and no directory."""

    name, version = "no_text", 0

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, params, *args, **kwargs):
        pass


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
