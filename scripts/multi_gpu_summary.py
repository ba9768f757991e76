"""Summarise ``multi_gpu.sh`` logs: tok/s per strategy and GPU count (median of the monitor's
lines after the first two), scaling against one GPU, and the loss/resume checks.

Usage: ``python scripts/multi_gpu_summary.py OUT_DIR``
"""

import re
import statistics
import sys
from pathlib import Path

LINE = re.compile(r"step (\d+) \| loss ([\d.na]+) .*\| tok/s ([\d,]+) \| mfu ([\d.]+%|n/a)")
VAL = re.compile(r"step (\d+) \| val/loss ([\d.]+)")


def read(log: Path) -> dict:
    lines, val = [], {}
    for text in log.read_text(errors="replace").splitlines():
        if m := LINE.search(text):
            lines.append((int(m[1]), float(m[3].replace(",", "")), m[4]))
        elif m := VAL.search(text):
            val[int(m[1])] = float(m[2])
    kept = lines[2:] or lines
    return {"tok_s": statistics.median(t for _, t, _ in kept) if kept else None,
            "mfu": kept[-1][2] if kept else None, "val": val, "text": log.read_text(errors="replace")}


def main(out: Path) -> None:
    print(f"device: {(out / 'gpu.txt').read_text().strip() if (out / 'gpu.txt').exists() else '?'}; "
          f"commit {(out / 'commit.txt').read_text().strip()[:7] if (out / 'commit.txt').exists() else '?'}")
    for model in ("gpt2", "gpt-1.3b"):
        runs = {p.stem.removeprefix(f"tp-{model}-"): read(p) for p in out.glob(f"tp-{model}-*gpu.log")
                if p.stem.removeprefix(f"tp-{model}-").count("-") <= 2}
        if not runs:
            continue
        base = runs.get("1gpu", {}).get("tok_s")
        print(f"\nthroughput {model} (FP8 delayed, tok/s over all GPUs; scaling = tok/s / (N x 1-GPU tok/s))")
        for name in ["1gpu", "ddp-2gpu", "fsdp-2gpu", "ddp-4gpu", "fsdp-4gpu"]:
            r = runs.get(name)
            if r is None:
                continue
            n = 1 if name == "1gpu" else int(name[-4])
            if r["tok_s"] is None:
                print(f"  {name:<10} no tok/s lines (see the log)")
                continue
            scaling = f"{r['tok_s'] / (n * base):.2f}" if base else "-"
            print(f"  {name:<10} {r['tok_s']:>12,.0f} tok/s  {r['tok_s'] / n:>10,.0f} per GPU  "
                  f"scaling {scaling}  mfu {r['mfu']}")
    losses = {p.stem.removeprefix("loss-"): read(p) for p in out.glob("loss-*.log")}
    if losses:
        ref = losses.get("1gpu", {}).get("val", {}).get(200)
        print("\nloss at step 200 (global batch 32 x 1024, FP8 delayed; val loss, 40 batches;"
              " fsdp = FSDP2 with bfloat16 gathers)")
        for name, r in sorted(losses.items()):
            v = r["val"].get(200)
            gap = f"{100 * (v - ref) / ref:+.2f}%" if v is not None and ref else "-"
            print(f"  {name:<22} {'-' if v is None else f'{v:.4f}':>8}  vs 1 GPU {gap}")
            for pattern in ("FP8 scaling state restored for \\d+ TE modules", "data: resumed at [^\\n]*",
                            "FP8 verified: [^\\n]*", "sample \\(step 200\\)[^\\n]{0,80}"):
                if m := re.search(pattern, r["text"]):
                    print(f"      {m[0]}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
