"""Mean and spread over seeds of each recipe's final validation loss, from convergence.sh's
``$OUT/tb-<recipe>-s<seed>`` event files, and each recipe's mean gap to BF16's (the criterion of
docs/convergence.md: within 1%).

Usage: python scripts/convergence_summary.py OUT
"""

import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from fp8_lightning.commands.compare import read_run, stopped_apart, val_at


def main(out: str) -> None:
    runs = {run_dir.name: read_run(str(run_dir)) for run_dir in sorted(Path(out).glob("tb-*-s*"))}
    # runs stopped at different steps (RUN_TIMEOUT) are read where all of them validated
    _, step = stopped_apart(list(runs.values()))
    if step is not None:
        print(f"(the runs stopped apart: every value is the validation loss at step {step})")
    finals: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for name, run in runs.items():
        recipe, seed = re.fullmatch(r"tb-(.+)-s(\d+)", name).groups()
        value = val_at(run, step)
        if value is not None:
            finals[recipe].append((seed, value))
    base = statistics.mean(v for _, v in finals["bf16"]) if finals.get("bf16") else None
    print("recipe         | seeds | final val loss per seed      | mean   | spread (max-min) | gap to BF16")
    for recipe in sorted(finals, key=lambda r: (r != "bf16", r)):
        values = [v for _, v in finals[recipe]]
        mean = statistics.mean(values)
        gap = f"{mean / base - 1:+.2%}" if base else "-"
        per_seed = " ".join(f"{v:.4f}" for v in values)
        print(f"{recipe:<14} | {len(values):<5} | {per_seed:<28} | {mean:.4f} | "
              f"{max(values) - min(values):.4f}           | {gap}")


if __name__ == "__main__":
    main(sys.argv[1])
