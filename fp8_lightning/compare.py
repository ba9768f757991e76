"""``python -m fp8_lightning compare RUN_DIR RUN_DIR [...]``: the FP8-vs-BF16 comparison.

Reads the TensorBoard event files of each run (the scalars ``TrainingMonitor`` and the
LightningModule write, see :mod:`fp8_lightning.monitor`), writes one PNG (loss against tokens
seen, throughput against tokens seen) and prints a table: final and minimum training loss, final
validation loss and its gap to the first run's, mean tok/s and the speedup over the first run.

A RUN_DIR is a run's ``default_root_dir``, its ``lightning_logs`` or one ``version_N`` folder;
where it holds several versions the newest is used (and the choice is printed).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .monitor import (FP8_ACTIVE, PRECISION_TEXT, TOKENS_PER_SEC, TOKENS_SEEN, TRAIN_LOSS,
                      VAL_LOSS)

Series = list[tuple[int, float]]  # (step, value)


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


def find_log_dir(run_dir: str) -> tuple[Path, str]:
    """The folder with the TensorBoard events of ``run_dir`` (the newest version if several)."""
    root = Path(run_dir).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"run directory {str(root)!r} does not exist")
    folders = sorted({p.parent for p in root.rglob("events.out.tfevents.*")},
                     key=lambda d: max(f.stat().st_mtime for f in d.glob("events.out.tfevents.*")))
    if not folders:
        raise FileNotFoundError(f"no TensorBoard event files under {str(root)!r} (a run's "
                                "default_root_dir or its lightning_logs/version_N)")
    note = ""
    if len(folders) > 1:
        note = (f"{root}: {len(folders)} logged runs, using the newest "
                f"({folders[-1].relative_to(root)}); pass a version folder to pick another")
    return folders[-1], note


def read_run(run_dir: str, label: Optional[str] = None) -> Run:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir, note = find_log_dir(run_dir)
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    run = Run(label or run_dir, log_dir, note=note)
    for tag in tags.get("scalars", []):
        by_step: dict[int, float] = {}
        for event in acc.Scalars(tag):
            by_step[event.step] = event.value  # a resumed run logs a step again: keep the last
        run.scalars[tag] = sorted(by_step.items())
    text_tag = f"{PRECISION_TEXT}/text_summary"
    if text_tag in tags.get("tensors", []):
        events = acc.Tensors(text_tag)
        if events and events[-1].tensor_proto.string_val:
            text = events[-1].tensor_proto.string_val[0].decode("utf-8", "replace")
            # "BF16 (fallback: <long reason>)" -> "BF16 (fallback)"; the reason is in the logs
            run.precision = text.split(" (")[0] + (" (fallback)" if "fallback" in text else "")
    elif run.series(FP8_ACTIVE):
        active = [v for _, v in run.series(FP8_ACTIVE)]
        run.precision = "FP8" if sum(active) / len(active) > 0.5 else "BF16"
    if run.series(FP8_ACTIVE) and run.precision.startswith("FP8"):
        off = sum(1 for _, v in run.series(FP8_ACTIVE) if v < 0.5)
        if off:
            run.precision += f" (BF16 at {off} of {len(run.series(FP8_ACTIVE))} log points)"
    return run


def mean_throughput(run: Run) -> Optional[float]:
    """Mean tok/s over the log points, the first (warm-up, compilation) left out when possible."""
    values = [v for _, v in run.series(TOKENS_PER_SEC)]
    if len(values) > 1:
        values = values[1:]
    return sum(values) / len(values) if values else None


def _last(run: Run, tag: str) -> Optional[float]:
    values = run.series(tag)
    return values[-1][1] if values else None


def summary(runs: list[Run]) -> list[dict[str, object]]:
    """One row per run; ``val gap`` and ``speedup`` are relative to the first run."""
    rows = []
    base = mean_throughput(runs[0]) if runs else None
    base_val = _last(runs[0], VAL_LOSS) if runs else None
    for run in runs:
        loss = [v for _, v in run.series(TRAIN_LOSS)]
        tps = mean_throughput(run)
        final_val = _last(run, VAL_LOSS)
        rows.append({
            "run": run.label, "precision": run.precision,
            "final loss": loss[-1] if loss else None, "min loss": min(loss) if loss else None,
            "final val loss": final_val,
            "val gap": (final_val / base_val - 1) if final_val and base_val else None,
            "mean tok/s": tps, "speedup": (tps / base) if tps and base else None,
        })
    return rows


def format_table(rows: list[dict[str, object]]) -> str:
    def cell(key: str, value: object) -> str:
        if value is None:
            return "n/a"
        if key == "mean tok/s":
            return f"{value:,.0f}"
        if key == "speedup":
            return f"{value:.2f}x"
        if key == "val gap":
            return f"{100 * value:+.2f}%"
        if isinstance(value, float):
            return f"{value:.4f}"
        return str(value)

    if not rows:
        return ""
    keys = list(rows[0])
    cells = [[cell(k, row[k]) for k in keys] for row in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    left = {"run", "precision"}

    def line(values: list[str]) -> str:
        return " | ".join(v.ljust(w) if k in left else v.rjust(w)
                          for k, v, w in zip(keys, values, widths))

    return "\n".join([line(keys), "-+-".join("-" * w for w in widths)] + [line(c) for c in cells])


def plot(runs: list[Run], output: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        name = f"{run.label} ({run.precision})"
        for tag, style, suffix in ((TRAIN_LOSS, "-", "train"), (VAL_LOSS, "o--", "val")):
            points = run.series(tag)
            if points:
                tokens = run.tokens_at([s for s, _ in points])
                ax_loss.plot(tokens, [v for _, v in points], style, color=color,
                             label=f"{name} {suffix}", markersize=4, linewidth=1.2)
        points = run.series(TOKENS_PER_SEC)
        if points:
            ax_tps.plot(run.tokens_at([s for s, _ in points]), [v for _, v in points], "-",
                        color=color, label=name)
    ax_loss.set(xlabel="tokens seen", ylabel="loss", title="loss vs tokens")
    ax_tps.set(xlabel="tokens seen", ylabel="tokens / s", title="throughput")
    for ax in (ax_loss, ax_tps):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(output).expanduser()
    if not path.suffix:  # matplotlib would write NAME.png: name the file that is written
        path = path.with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def compare(run_dirs: list[str], output: str = "compare.png",
            labels: Optional[list[str]] = None) -> tuple[list[dict[str, object]], Path]:
    """Read the runs, write the PNG, return the table rows and the PNG's path."""
    if not run_dirs:
        raise FileNotFoundError("compare needs at least one RUN_DIR")
    if labels and len(labels) != len(run_dirs):
        from .config import ConfigError

        raise ConfigError([f"{len(labels)} labels for {len(run_dirs)} runs"], "compare")
    if Path(output).expanduser().is_dir():
        from .config import ConfigError

        raise ConfigError([f"--output {output!r} is a directory; give a file name such as "
                           f"{str(Path(output) / 'compare.png')!r}"], "compare")
    runs = [read_run(d, labels[i] if labels else None) for i, d in enumerate(run_dirs)]
    for run in runs:
        if run.note:
            print(f"note: {run.note}", file=sys.stderr)
    rows = summary(runs)
    return rows, plot(runs, output)


class _Parser(argparse.ArgumentParser):
    """One ``error:`` line (printed by ``cli.main``), no usage dump, no abbreviated options."""

    def error(self, message: str) -> None:  # type: ignore[override]
        from .config import UsageError

        raise UsageError(f"{message} (options: {self.prog} --help)")


def main(argv: list[str]) -> None:
    parser = _Parser(
        allow_abbrev=False, prog="python -m fp8_lightning compare",
        description="Compare runs from their TensorBoard logs: a PNG of loss vs tokens and "
                    "throughput, and a table (final/min loss, final val loss, mean tok/s, "
                    "speedup vs the first run).")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="a run's default_root_dir, lightning_logs or version_N folder")
    parser.add_argument("--output", "-o", default="compare.png", help="the PNG (default: %(default)s)")
    parser.add_argument("--labels", nargs="+", default=None, help="a label per run")
    args = parser.parse_args(argv)
    import logging

    logging.getLogger("tensorboard").setLevel(logging.WARNING)  # its INFO lines are noise here
    rows, path = compare(args.run_dirs, args.output, args.labels)
    print(format_table(rows))
    print(f"plot: {path}")
