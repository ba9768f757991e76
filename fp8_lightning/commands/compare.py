"""``python -m fp8_lightning compare RUN_DIR RUN_DIR [...]``: the FP8-vs-BF16 comparison.

Reads each run's logs, TensorBoard event files or a CSVLogger's ``metrics.csv`` (the scalars
``TrainingMonitor`` and the LightningModule write, see :mod:`fp8_lightning.logs`), prints a
table and writes one PNG:

* **final loss**: the console's last line, the mean training loss over that line's window
  (``train/loss_mean``, computed once by the monitor); **min loss** the lowest such line.
  Logs written before that scalar existed fall back to the last logged micro-batch (a note says so).
* **tok/s**: the median over the log windows, leaving out the first (warm-up, compilation) and
  those that held a validation or a checkpoint save (``throughput/paused``). **speedup**: the ratio
  of medians to the first run's; within the runs' combined per-window spread it is reported as
  indistinguishable (within noise ±x%).
* **the seed band**: given several runs of the baseline (BF16 runs with different seeds), their
  range of final losses is the band a run must sit in to train "the same"; each other run gets one
  ``verdict:`` line (inside, above or below the band, and its gap to the band's mean). The
  baseline is every run logged as plain BF16, or the first ``--baseline K`` runs. Runs whose last
  validations are at different steps (one stopped early) are judged, and their val gap read, at
  the last validation step they all have, and a note says so.
* The PNG: loss vs tokens seen (millions) with validation points marked and the band shaded, the
  difference of every run's loss to the first run's (with a band: to the band's mean; so identical
  runs show as a flat line, not as one curve hiding another), the last part of the loss enlarged,
  and throughput (paused windows left out).

A RUN_DIR is a run's ``default_root_dir``, its ``lightning_logs`` or one ``version_N`` folder;
of several versions, the newest with the runs it resumed (``--ckpt_path last``) before it are read
as one curve, and a note says which were read.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..config import ConfigError
from ..logs import (FP8_ACTIVE, PAUSED, PRECISION_TEXT, TEXT_FILE, TOKENS_PER_SEC, TOKENS_SEEN,
                   TRAIN_LOSS, TRAIN_LOSS_MEAN, VAL_LOSS, short_tag)
from ..plots import MissingExtraError, pyplot

Series = list[tuple[int, float]]  # (step, value)
EVENTS = "events.out.tfevents.*"
METRICS_CSV = "metrics.csv"  # CSVLogger's file


@dataclass
class Run:
    label: str
    log_dir: Path
    scalars: dict[str, Series] = field(default_factory=dict)
    precision: str = "?"
    note: str = ""

    def series(self, tag: str) -> Series:
        return self.scalars.get(tag, [])

    def tokens_at(self, steps: list[int]) -> list[float]:
        """Tokens seen at each step, interpolated from the ``tokens_seen`` scalar."""
        import numpy as np

        points = sorted(self.series(TOKENS_SEEN))
        if not points:
            return [float("nan")] * len(steps)
        xs = [-1] + [s for s, _ in points]  # step -1: before the first batch, 0 tokens
        ys = [0.0] + [v for _, v in points]
        per_step = (ys[-1] - ys[0]) / (xs[-1] - xs[0])
        out = np.interp(steps, xs, ys)
        # beyond the last logged point: the same tokens per step
        return [float(o if s <= xs[-1] else ys[-1] + (s - xs[-1]) * per_step)
                for s, o in zip(steps, out)]

    @property
    def loss_tag(self) -> str:
        """The console line's loss where logged, else (older logs) the logged micro-batch."""
        return TRAIN_LOSS_MEAN if self.series(TRAIN_LOSS_MEAN) else TRAIN_LOSS


# ----------------------------------------------------------------------------- reading
def _log_files(folder: Path) -> list[Path]:
    return [*folder.glob(EVENTS), *folder.glob(METRICS_CSV)]


def find_log_dirs(run_dir: str) -> list[Path]:
    """The folders with the logs of ``run_dir``, oldest first (a version folder per start)."""
    root = Path(run_dir).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"run directory {str(root)!r} does not exist")
    found = {p.parent for pattern in (EVENTS, METRICS_CSV) for p in root.rglob(pattern)}
    folders = sorted(found, key=lambda d: max(f.stat().st_mtime for f in _log_files(d)))
    if not folders:
        raise FileNotFoundError(f"no TensorBoard event files under {str(root)!r} and no CSVLogger "
                                f"{METRICS_CSV} (give a run's default_root_dir or its "
                                "lightning_logs/version_N)")
    return folders


def _read_tensorboard(run: Run) -> Optional[str]:
    """Scalars into ``run``; the last ``run/precision`` text, if any."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logging.getLogger("tensorboard").setLevel(logging.WARNING)  # its INFO lines are noise here
    acc = EventAccumulator(str(run.log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    for tag in tags.get("scalars", []):
        by_step: dict[int, float] = {}
        for event in acc.Scalars(tag):
            by_step[event.step] = event.value  # a resumed run logs a step again: keep the last
        run.scalars[tag] = sorted(by_step.items())
    text_tag = f"{PRECISION_TEXT}/text_summary"
    if text_tag in tags.get("tensors", []):
        events = acc.Tensors(text_tag)
        if events and events[-1].tensor_proto.string_val:
            return events[-1].tensor_proto.string_val[0].decode("utf-8", "replace")
    return None


def _read_csv(run: Run) -> Optional[str]:
    """A CSVLogger's ``metrics.csv`` into ``run``; the last ``run/precision`` of ``text.jsonl``."""
    by_tag: dict[str, dict[int, float]] = {}
    with open(run.log_dir / METRICS_CSV, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            try:
                step = int(float(row.get("step") or ""))
            except ValueError:
                continue
            for tag, value in row.items():
                if tag in ("step", None) or value in ("", None):
                    continue
                try:
                    by_tag.setdefault(tag, {})[step] = float(value)
                except ValueError:
                    continue
    run.scalars = {tag: sorted(values.items()) for tag, values in by_tag.items()}
    text = None
    path = run.log_dir / TEXT_FILE
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("tag") == PRECISION_TEXT:
                text = str(entry.get("text"))
    return text


def _first_step(run: Run) -> Optional[int]:
    points = run.series(run.loss_tag)  # (not hp_metric: the logger writes it at step 0 each start)
    return points[0][0] if points else None


def read_run(run_dir: str, label: Optional[str] = None) -> Run:
    """The newest logged run under ``run_dir``, with the runs it resumed (``--ckpt_path last``
    logs into a new version folder) before it: each older one, read only while the chain goes
    on, up to the step the next began."""
    folders, run, text, newest, chained = find_log_dirs(run_dir), None, None, None, 0
    for folder in reversed(folders):
        prev = Run(label or run_dir, folder)
        prev_text = _read_tensorboard(prev) if any(folder.glob(EVENTS)) else _read_csv(prev)
        newest, start = newest or (prev, prev_text), _first_step(prev)
        if start is None:
            continue  # an empty version (a resume of a finished run)
        if run is None:
            run, text = prev, prev_text
        elif start >= (first := _first_step(run)):
            break  # the newer run started afresh, not from this one
        else:
            for tag, series in prev.scalars.items():
                run.scalars[tag] = [p for p in series if p[0] < first] + run.series(tag)
        chained += 1
    run, text = (run, text) if run is not None else newest  # none logged a loss: the newest
    if chained > 1:
        run.note = f"{run_dir}: {chained} logged runs, each resumed from the one before: read as one"
    elif len(folders) > 1:
        run.note = (f"{run_dir}: {len(folders)} logged runs, using the newest "
                    f"({run.log_dir.relative_to(Path(run_dir).expanduser())}); pass a version "
                    "folder to pick another")
    if text:
        run.precision = short_tag(text)  # the reason is in the logs
    elif run.series(FP8_ACTIVE):
        active = [v for _, v in run.series(FP8_ACTIVE)]
        run.precision = "FP8" if sum(active) / len(active) > 0.5 else "BF16"
    if run.series(FP8_ACTIVE) and run.precision.startswith("FP8"):
        off = sum(1 for _, v in run.series(FP8_ACTIVE) if v < 0.5)
        if off:
            run.precision += f" (BF16 at {off} of {len(run.series(FP8_ACTIVE))} log points)"
    return run


# ----------------------------------------------------------------------------- numbers
@dataclass
class Throughput:
    median: float
    spread: Optional[float]  # relative per-window spread (robust standard deviation / median)
    windows: int  # windows used


def throughput_windows(run: Run) -> Series:
    """Per-window tok/s without the first window (warm-up, compilation) and without windows that
    held a validation or a checkpoint save (``throughput/paused``; logs without it: the window
    after each validation)."""
    points = run.series(TOKENS_PER_SEC)[1:]
    paused = dict(run.series(PAUSED))
    if paused:
        return [(s, v) for s, v in points if paused.get(s, 0.0) < 0.5]
    vals = [s for s, _ in run.series(VAL_LOSS)]
    out, prev = [], run.series(TOKENS_PER_SEC)[0][0] if points else 0
    for s, v in points:
        if not any(prev <= val <= s for val in vals):
            out.append((s, v))
        prev = s
    return out


def throughput(run: Run) -> Optional[Throughput]:
    values = [v for _, v in throughput_windows(run)]
    if not values:
        return None
    center = statistics.median(values)
    spread = None
    if len(values) >= 3 and center > 0:
        # 1.4826 x the median absolute deviation: the standard deviation for normal noise, and
        # robust to the odd slow window (another process, a data-loader hiccup).
        spread = 1.4826 * statistics.median(abs(v - center) for v in values) / center
    return Throughput(center, spread, len(values))


def speedup(base: Optional[Throughput], run: Optional[Throughput]) -> tuple[Optional[float], Optional[float]]:
    """(ratio of median tok/s, noise): noise is the runs' combined relative spread."""
    if base is None or run is None or base.median <= 0:
        return None, None
    noise = (math.hypot(base.spread, run.spread)
             if base.spread is not None and run.spread is not None else None)
    return run.median / base.median, noise


def _last(run: Run, tag: str) -> Optional[float]:
    values = run.series(tag)
    return values[-1][1] if values else None


def shared_val_step(runs: list[Run]) -> Optional[int]:
    """The last step at which every run that validated logged a validation loss (None: none in
    common): runs stopped at different steps are compared there, not at their own ends."""
    steps = [{step for step, _ in run.series(VAL_LOSS)} for run in runs if run.series(VAL_LOSS)]
    common = set.intersection(*steps) if steps else set()
    return max(common) if common else None


def val_at(run: Run, step: Optional[int]) -> Optional[float]:
    """``run``'s validation loss at ``step`` (None: its last)."""
    values = run.series(VAL_LOSS)
    if step is None:
        return values[-1][1] if values else None
    return next((v for s, v in reversed(values) if s == step), None)


def stopped_apart(runs: list[Run]) -> tuple[bool, Optional[int]]:
    """Whether the runs' last validations are at different steps, and then the step to read
    them at: :func:`shared_val_step` (None where they share none)."""
    if len({run.series(VAL_LOSS)[-1][0] for run in runs if run.series(VAL_LOSS)}) < 2:
        return False, None
    return True, shared_val_step(runs)


def ends_apart(runs: list[Run]) -> Optional[str]:
    """A note where the runs' last validations are at different steps, else None."""
    apart, step = stopped_apart(runs)
    if not apart:
        return None
    ends = {run.label: run.series(VAL_LOSS)[-1][0] for run in runs if run.series(VAL_LOSS)}
    read = (f"the val gap and verdicts read step {step}, the last validation every run has"
            if step is not None else "they share no validation step: the val gap is not computed")
    return ("note: the runs' last validations are at different steps ("
            + ", ".join(f"{label}: {end}" for label, end in ends.items()) + f"); {read}")


def final_loss(run: Run) -> Optional[float]:
    """The console's final loss: the last line's mean over its window (``train/loss_mean``)."""
    return _last(run, run.loss_tag)


def summary(runs: list[Run]) -> list[dict[str, object]]:
    """One row per run; ``val gap`` and ``speedup`` are relative to the first run."""
    rows = []
    base = throughput(runs[0]) if runs else None
    apart, at = stopped_apart(runs)  # runs that stopped apart: read where all validated
    base_val = val_at(runs[0], at) if runs and not (apart and at is None) else None
    for run in runs:
        loss = [v for _, v in run.series(run.loss_tag)]
        tps = throughput(run)
        ratio, noise = speedup(base, tps)
        final_val = _last(run, VAL_LOSS)
        rows.append({
            "run": run.label, "precision": run.precision,
            "final loss": final_loss(run), "min loss": min(loss) if loss else None,
            "final val loss": final_val,
            "val gap": (val_at(run, at) / base_val - 1) if final_val and base_val else None,
            "tok/s": tps.median if tps else None, "speedup": ratio, "noise": noise,
        })
    return rows


def speedup_text(ratio: Optional[float], noise: Optional[float], first: bool = False) -> str:
    if ratio is None:
        return "n/a"
    if first:
        return f"{ratio:.2f}x"
    if noise is None:
        return f"{ratio:.2f}x (too few windows to judge noise)"
    if abs(ratio - 1) <= noise:
        return f"{ratio:.2f}x: indistinguishable (within noise ±{100 * noise:.1f}%)"
    return f"{ratio:.2f}x (noise ±{100 * noise:.1f}%)"


def format_table(rows: list[dict[str, object]]) -> str:
    def cell(key: str, value: object, row: dict[str, object], first: bool) -> str:
        if key == "speedup":
            return speedup_text(value, row.get("noise"), first)  # type: ignore[arg-type]
        if value is None:
            return "n/a"
        if key == "tok/s":
            return f"{value:,.0f}"
        if key == "val gap":
            return f"{100 * value:+.2f}%"
        if isinstance(value, float):
            return f"{value:.4f}"
        return str(value)

    if not rows:
        return ""
    keys = [k for k in rows[0] if k != "noise"]
    cells = [[cell(k, row[k], row, i == 0) for k in keys] for i, row in enumerate(rows)]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    left = {"run", "precision", "speedup"}

    def line(values: list[str]) -> str:
        return " | ".join(v.ljust(w) if k in left else v.rjust(w)
                          for k, v, w in zip(keys, values, widths)).rstrip()

    return "\n".join([line(keys), "-+-".join("-" * w for w in widths)] + [line(c) for c in cells])


def legend(runs: list[Run]) -> str:
    """What the table's columns are, below it."""
    old = [r.label for r in runs if not r.series(TRAIN_LOSS_MEAN)]
    loss = "final/min loss: the console line's loss (mean over the steps since the previous line)"
    if old:
        loss += (f"; {'all runs' if len(old) == len(runs) else ', '.join(old)}: the logged "
                 "micro-batch (logs written before train/loss_mean)")
    return (f"{loss}\ntok/s: median over the log windows without warm-up, validation or "
            f"checkpoint saves; speedup: vs {runs[0].label}, indistinguishable within the runs' "
            "combined per-window spread")


# ----------------------------------------------------------------------------- the seed band
@dataclass
class Band:
    """The baseline's seeds: the spread of their final losses is what "the same loss" means."""

    runs: list[Run]
    name: str  # "BF16", or "the baseline" for runs picked by --baseline
    metric: str  # "final val loss" where every run has one, else the console's "final loss"
    step: Optional[int] = None  # runs that stopped apart: the validation step they share

    def final(self, run: Run) -> Optional[float]:
        return final_loss(run) if self.metric == "final loss" else val_at(run, self.step)

    @property
    def values(self) -> list[float]:
        return [v for v in map(self.final, self.runs) if v is not None]

    def verdict(self, run: Run) -> str:
        """One line: does ``run``'s final loss sit inside the band?"""
        values, value = self.values, self.final(run)
        low, high, mean = min(values), max(values), statistics.mean(values)
        head = f"verdict: {run.label} ({run.precision}): {self.metric}"
        if value is None:
            return f"{head} n/a: not logged"
        where = (f"inside {self.name}'s seed band" if low <= value <= high else
                 f"{100 * (value / high - 1):.2f}% above {self.name}'s seed band" if value > high else
                 f"{100 * (1 - value / low):.2f}% below (lower loss than) {self.name}'s seed band")
        return (f"{head} {value:.4f} is {where} {low:.4f}-{high:.4f} ({len(values)} runs), "
                f"{100 * (value / mean - 1):+.2f}% from its mean")


def plain_bf16(run: Run) -> bool:
    """Logged as plain BF16: by FP8Precision's BF16 (not a fallback), or by the Trainer's own
    ``precision: bf16-mixed`` / ``bf16-true`` (configs/gpt2_bf16.yaml)."""
    return run.precision in ("BF16", "bf16-mixed", "bf16-true")


def seed_band(runs: list[Run], baseline: Optional[int] = None) -> Optional[Band]:
    """The first ``baseline`` runs, or (``None``) every run logged as plain BF16, if at least two."""
    picked = runs[:baseline] if baseline else [r for r in runs if plain_bf16(r)]
    if len(picked) < 2:
        return None
    name = "BF16" if all(map(plain_bf16, picked)) else "the baseline"
    apart, step = stopped_apart(runs)
    if step is not None:
        return Band(picked, name, f"val loss at step {step}", step)
    with_val = not apart and all(_last(r, VAL_LOSS) is not None for r in runs)
    return Band(picked, name, "final val loss" if with_val else "final loss")


def band_curve(band: Band, tag: str, x: list[float]) -> tuple[list[float], list[float], list[float]]:
    """(low, mean, high) of the band's runs' ``tag`` at tokens ``x`` (linear in between)."""
    import numpy as np

    curves = []
    for run in band.runs:
        series = run.series(tag)
        rx = np.array(run.tokens_at([s for s, _ in series]))
        curves.append(np.interp(x, rx, [v for _, v in series], left=np.nan, right=np.nan))
    stack = np.array(curves)
    return stack.min(axis=0), stack.mean(axis=0), stack.max(axis=0)


# ----------------------------------------------------------------------------- the figure
STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def _tokens_unit(runs: list[Run]) -> tuple[float, str]:
    most = max((v for r in runs for _, v in r.series(TOKENS_SEEN)), default=0.0)
    return (1e6, "millions") if most >= 1e6 else (1e3, "thousands")


def _running_median(values: list[float], width: int = 5) -> list[float]:
    half = width // 2
    return [statistics.median(values[max(0, i - half):i + half + 1]) for i in range(len(values))]


def plot(runs: list[Run], output: str, band: Optional[Band] = None) -> Path:
    import numpy as np

    plt = pyplot("compare's plot")
    from matplotlib.ticker import FuncFormatter, ScalarFormatter

    scale, unit = _tokens_unit(runs)
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    (ax_loss, ax_diff), (ax_zoom, ax_tps) = axes
    base = runs[0] if band is None else band.runs[0]
    base_loss = base.series(base.loss_tag)
    base_x = np.array(base.tokens_at([s for s, _ in base_loss])) / scale
    base_y = np.array([v for _, v in base_loss])
    base_val = dict(base.series(VAL_LOSS))
    reference = base.label
    if band is not None:  # the band's mean is the reference; its range shaded on the loss panels
        low, base_y, high = band_curve(band, base.loss_tag, list(base_x * scale))
        reference = f"{band.name} seeds' mean"
        for ax in (ax_loss, ax_zoom):
            ax.fill_between(base_x, low, high, color="0.5", alpha=0.25, linewidth=0,
                            label=f"{band.name} seed band ({len(band.runs)} runs)")
        ax_diff.fill_between(base_x, low - base_y, high - base_y, color="0.5", alpha=0.25,
                             linewidth=0, label=f"{band.name} seed band")
        val_steps = set.intersection(*(set(dict(r.series(VAL_LOSS))) for r in band.runs))
        base_val = {s: statistics.mean(dict(r.series(VAL_LOSS))[s] for r in band.runs)
                    for s in val_steps}
    last_x = 0.0
    for i, run in enumerate(runs):
        color, style, marker = f"C{i % 10}", STYLES[i % len(STYLES)], MARKERS[i % len(MARKERS)]
        name = f"{run.label} ({run.precision})"
        loss = run.series(run.loss_tag)
        x = np.array(run.tokens_at([s for s, _ in loss])) / scale
        y = np.array([v for _, v in loss])
        val = run.series(VAL_LOSS)
        val_x = np.array(run.tokens_at([s for s, _ in val])) / scale
        val_y = np.array([v for _, v in val])
        every = max(1, len(x) // 12)
        # wider lines under narrower ones: overlapping runs stay visible
        width = 1.0 + 1.2 * (len(runs) - 1 - i) / max(1, len(runs) - 1)
        val_size = 11 - 5 * i / max(1, len(runs) - 1)
        for ax in (ax_loss, ax_zoom):
            if len(x):
                ax.plot(x, y, style, color=color, linewidth=width, marker=marker, markevery=every,
                        markersize=4, label=f"{name} train")
            if len(val_x):  # the first run's markers largest: identical points stay visible
                ax.plot(val_x, val_y, marker, color=color, markersize=val_size, markerfacecolor="none",
                        markeredgewidth=1.5, linestyle="none", label=f"{name} val")
        if len(x):
            last_x = max(last_x, float(x[-1]))
        if (run is not base or band is not None) and len(x) and len(base_x):
            diff = y - np.interp(x, base_x, base_y, left=np.nan, right=np.nan)
            ax_diff.plot(x, diff, style, color=color, linewidth=width, marker=marker,
                         markevery=every, markersize=4, label=f"{name} train")
            common = [(vx, v - base_val[s]) for (s, v), vx in zip(val, val_x) if s in base_val]
            if common:
                ax_diff.plot(*zip(*common), marker, color=color, markersize=val_size,
                             markerfacecolor="none", markeredgewidth=1.5, linestyle="none",
                             label=f"{name} val")
        windows = throughput_windows(run)
        if windows:
            tx = np.array(run.tokens_at([s for s, _ in windows])) / scale
            tv = [v for _, v in windows]
            ax_tps.plot(tx, tv, marker, color=color, markersize=3, alpha=0.35, linestyle="none")
            ax_tps.plot(tx, _running_median(tv), style, color=color, linewidth=width, label=name)
    ax_diff.axhline(0.0, color="C0", linewidth=1.0)
    train = ("train: the console line's mean" if all(r.series(TRAIN_LOSS_MEAN) for r in runs)
             else "train: the logged micro-batch")
    ax_loss.set(ylabel="loss", title=f"loss vs tokens ({train}; validation: open markers)")
    ax_diff.set(ylabel=f"loss - {reference}", title=f"difference to {reference}")
    ax_zoom.set(ylabel="loss", title="the last 30% of the run")
    ax_tps.set(ylabel="tokens / s", title="throughput: log windows without warm-up, validation or "
               "checkpoint\n(dots), their 5-window running median (line)")
    if last_x > 0:  # the zoom's y range: what lies in its x range
        start = 0.7 * last_x
        ax_zoom.set_xlim(start, last_x * 1.01)
        in_view = [v for r in runs for tag in (r.loss_tag, VAL_LOSS) for (s, v), t in
                   zip(r.series(tag), r.tokens_at([s for s, _ in r.series(tag)])) if t / scale >= start]
        if in_view:
            low, high = min(in_view), max(in_view)
            pad = 0.05 * (high - low) or 0.01 * abs(high) or 0.01
            ax_zoom.set_ylim(low - pad, high + pad)
    for ax in axes.flat:
        ax.set_xlabel(f"tokens seen ({unit})")
        ax.grid(alpha=0.3)
        for axis in (ax.xaxis, ax.yaxis):  # plain numbers: no "1e7" offset or exponent
            formatter = ScalarFormatter(useOffset=False)
            formatter.set_scientific(False)
            axis.set_major_formatter(formatter)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    ax_tps.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    fig.tight_layout()
    path = Path(output).expanduser()
    if not path.suffix:  # matplotlib would write NAME.png: name the file that is written
        path = path.with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- the command
def compare(run_dirs: list[str], output: str = "compare.png", labels: Optional[list[str]] = None,
            baseline: Optional[int] = None) -> tuple[list[dict[str, object]], Path]:
    """Compare runs from their logs (TensorBoard or CSV): compare RUN_DIR [RUN_DIR ...]
    [--labels A [B ...]] [--baseline K] [--output PNG]; the first run is the baseline.

    Prints final/min loss (the console line's), final val loss and its gap to the first run,
    median tok/s and the speedup over the first run (or that it is within noise); given several
    seeds of the baseline, a verdict line per other run: inside their band of final losses or not.
    Writes loss vs tokens (the band shaded), the difference to the first run (or the band's mean),
    the last part enlarged and throughput to ``output``.

    Args:
        run_dirs: RUN_DIR ...: each a run's default_root_dir, lightning_logs or version_N folder
            (TensorBoard or CSVLogger logs; the first run is the baseline).
        output: the PNG.
        labels: a label per run (default: the RUN_DIRs).
        baseline: the first K runs are seeds of the baseline, whose range of final losses is the
            band the other runs are judged against (default: every run logged as plain BF16,
            where there are two or more).
    """
    if not run_dirs:
        raise ConfigError(["give at least one RUN_DIR"], "compare")
    problems = []
    if labels and len(labels) != len(run_dirs):
        problems.append(f"{len(labels)} labels for {len(run_dirs)} runs")
    if baseline is not None and not 2 <= baseline <= len(run_dirs):
        problems.append(f"--baseline {baseline}: a seed band needs 2 to {len(run_dirs)} runs "
                        f"(the first K of the {len(run_dirs)} given)")
    if problems:
        raise ConfigError(problems, "compare")
    if Path(output).expanduser().is_dir():
        raise ConfigError([f"--output {output!r} is a directory; give a file name such as "
                           f"{str(Path(output) / 'compare.png')!r}"], "compare")
    runs = [read_run(d, labels[i] if labels else None) for i, d in enumerate(run_dirs)]
    for run in runs:
        if run.note:
            print(f"note: {run.note}", file=sys.stderr)
    rows = summary(runs)
    print(format_table(rows))
    print(legend(runs))
    if note := ends_apart(runs):
        print(note)
    band = seed_band(runs, baseline)
    if band is not None:
        for run in runs:
            if all(run is not seed for seed in band.runs):
                print(band.verdict(run))
    elif sum(map(plain_bf16, runs)) == 1 and len(runs) > 1:
        print("note: one BF16 run, no seed band: give two or more BF16 seeds (or --baseline K) "
              "for a verdict on the others")
    try:  # after the table: without matplotlib the numbers still show, and the run succeeds
        path = plot(runs, output, band)
    except MissingExtraError as err:
        print(f"note: no plot: {err}")
        return rows, None
    print(f"plot: {path}")
    return rows, path
