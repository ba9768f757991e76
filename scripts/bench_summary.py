"""Summarise ``device_bench.sh`` output: one line per model and variant, and the doctor's
predicted FP8 speedups against the measured ones.

Usage: ``python scripts/bench_summary.py OUT_DIR`` (reads ``OUT_DIR/bench-*/bench.json`` and
``OUT_DIR/doctor-*.json``).
"""

import json
import sys
from pathlib import Path


def main(out: Path) -> None:
    benches = {}
    for path in sorted(out.glob("bench-*/bench.json")):
        report = json.loads(path.read_text())
        name = path.parent.name.removeprefix("bench-")
        benches[name] = {r["variant"]: r for r in report["results"]}
        s = report["setup"]
        print(f"\n{name}: {s['model']} {s['n_layer']} layers, {s['batch_size']} x {s['seq_len']}, "
              f"{report['env']['device']}, commit {report['env']['git_commit']}, "
              f"speedup vs {report['baseline']}")
        for r in report["results"]:
            if r["status"] == "ran":
                mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
                mem = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"
                print(f"  {r['variant']:<24}{r['tokens_per_s']:>12,.0f} tok/s {r['ms_per_step']:>9.2f} ms "
                      f"MFU {mfu:>6} {mem:>7} GiB {r['speedup']:>6.2f}x")
            else:
                print(f"  {r['variant']:<24}{r['status']}: {r['reason'][:90]}")
    print("\ndoctor probe vs bench (FP8 speedup over te-bf16):")
    for path in sorted(out.glob("doctor-*.json")):
        name = path.stem.removeprefix("doctor-")
        probe = json.loads(path.read_text()).get("probe") or {}
        measured = benches.get(name, {})
        for recipe, predicted in (probe.get("speedup") or {}).items():
            run, base = measured.get(f"fp8-{recipe}"), measured.get("te-bf16")
            if run and base and run["status"] == base["status"] == "ran":
                actual = base["ms_per_step"] / run["ms_per_step"]
                print(f"  {name:<12}{recipe:<9} predicted {predicted:.2f}x  measured {actual:.2f}x  "
                      f"error {100 * (predicted - actual) / actual:+.0f}%")
            else:
                print(f"  {name:<12}{recipe:<9} predicted {predicted:.2f}x  (no bench measurement)")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "bench_out"))
