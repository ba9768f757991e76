"""Plot and tabulate convergence runs from their console logs (TrainingMonitor lines).

Usage: python scripts/convergence_plot.py OUT_PNG RUN.log [RUN.log ...]   (the first run is the
reference for the gap column). Tokens = step x tokens per step (read from tok/s x dt).
"""

import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

VAL = re.compile(r"^step (\d+) \| val/loss ([\d.]+)")
TRAIN = re.compile(r"^step (\d+) \| loss ([\d.]+) .*\| dt ([\d.]+)ms \| tok/s ([\d,]+)")


def read(path):
    train, val, tokens_per_step = [], [], None
    for line in Path(path).read_text().splitlines():
        if m := VAL.match(line):
            val.append((int(m[1]), float(m[2])))
        elif m := TRAIN.match(line):
            train.append((int(m[1]), float(m[2])))
            tokens_per_step = float(m[4].replace(",", "")) * float(m[3]) / 1e3
    return train, val, round(tokens_per_step / 1024) * 1024 if tokens_per_step else 0


def main(out, *logs):
    runs = {Path(p).stem: read(p) for p in logs}
    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 4.5))
    ref = None
    print("| run | final val loss | gap to " + Path(logs[0]).stem + " | min val loss |")
    print("|---|---|---|---|")
    for name, (train, val, tps) in runs.items():
        ax_t.plot([s * tps / 1e6 for s, _ in train], [l for _, l in train], label=name, lw=1)
        ax_v.plot([s * tps / 1e6 for s, _ in val], [l for _, l in val], label=name, marker="o")
        final = val[-1][1]
        ref = final if ref is None else ref
        print(f"| {name} | {final:.4f} | {100 * (final - ref) / ref:+.2f}% | {min(l for _, l in val):.4f} |")
    for ax, title in ((ax_t, "train loss (mean over 25 steps)"), (ax_v, "validation loss")):
        ax.set_xlabel("tokens (M)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
