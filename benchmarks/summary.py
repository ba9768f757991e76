"""The harness's summary: its runs' logs (each headed by the harness's ``=== run {...}`` line,
which says what ran) as tables.

    python -m benchmarks.summary OUT

- GPT tables: tok/s per GPU (fit: the median of the monitor's lines after the first two and
  before StepProfile's steps; the plain script: of its 10-step windows; the Fabric example: of
  its lines after the first two), scaling against the same run's one GPU, the ratio over the
  fastest BF16 (package or plain script, any setting) of the same strategy and GPU count, MFU,
  and each run's StepProfile rows.
- The Llama table (val loss at the last step against the package's BF16), its evaluation,
  resume and throughput runs, the memory probe; the loss and resume checks; bench's tables
  (``OUT/bench-*/bench.json``) and doctor's prediction against them (``OUT/doctor-*.json``).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

HEADER = re.compile(r"^=== run (\{.*\})$", re.M)
# TrainingMonitor's console line (fp8_lightning/callbacks/monitor.py, format_line)
LINE = re.compile(r"step (\d+) \| loss ([\d.]+|nan|inf|n/a) .*\| dt ([\d.]+)ms \| tok/s ([\d,]+) \| "
                  r"mfu ([\d.]+%|n/a)")
VAL = re.compile(r"step (\d+) \| val/loss ([\d.]+)[^\n]*?(?:\| peak mem ([\d.]+) GiB[^\n]*)?$",
                 re.M)
# examples/fabric_train.py's line: tok/s per GPU, no MFU
FABRIC_LINE = re.compile(r"step +(\d+) \| loss ([\d.]+|nan|inf) \| lr \S+ \| (\d+) ms/step \| "
                         r"tok/s per GPU ([\d,]+)")
MEMORY = re.compile(r"memory: peak ([\d.]+) GiB in training")
PROFILED = re.compile(r"profile: steps (\d+)-(\d+)")
PROFILE_ROW = re.compile(r"^(\d+) +([\d.]+|n/a) +([\d.]+|n/a) +([\d.]+|n/a) +([\d.]+|n/a) +"
                         r"([\d.]+|n/a)", re.M)
EXIT = re.compile(r"^=== \S+: exit (-?\d+) after", re.M)


def median_mfu(values: list[str]) -> Optional[str]:
    """The median of the monitor's MFU fields ("45.4%", or "n/a" where unknown), as printed."""
    known = sorted((v for v in values if v.endswith("%")), key=lambda v: float(v[:-1]))
    return known[(len(known) - 1) // 2] if known else (values[0] if values else None)


def plain_result(text: str) -> Optional[dict[str, Any]]:
    """benchmarks/plain_pytorch.py's JSON line."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except json.JSONDecodeError:  # (another line that starts with a brace)
                continue
            if isinstance(result, dict) and result.get("script") == "plain_pytorch":
                return result
    return None


def read(log: Path) -> dict[str, Any]:
    """One run's log: what ran (its header), its step lines (steady: after the first two, before
    a profile), validations and peak memory, in the monitor's terms (tok/s of the whole run)."""
    text = log.read_text(errors="replace")
    header = HEADER.search(text)
    about = json.loads(header[1]) if header else {"name": log.stem}
    gpus = int(about.get("gpus") or 1)
    lines = [(int(m[1]), float(m[2]) if m[2] != "n/a" else None, float(m[3]),
              float(m[4].replace(",", "")), m[5]) for m in LINE.finditer(text)]
    if not lines:  # the Fabric example's lines: tok/s per GPU, made the run's
        lines = [(int(m[1]), float(m[2]), float(m[3]), gpus * float(m[4].replace(",", "")), "n/a")
                 for m in FABRIC_LINE.finditer(text)]
    kept = lines[2:] or lines
    profiled = PROFILED.search(text)
    if profiled:  # keep the lines whose window (previous line's step, step] ends before the
        # profiled steps (monitor steps A+1..): the profiled ones run slower, and every step after
        # them stays slower where the host sets the pace, because Kineto leaves CUPTI attached
        # after the profiler exits (pytorch/pytorch#144455; docs/benchmarks.md, Method)
        first = int(profiled[1]) + 1
        kept = [x for x in kept if x[0] < first] or kept
    vals = list(VAL.finditer(text))
    val = {int(m[1]): float(m[2]) for m in vals}
    peak = MEMORY.search(text)
    exits = EXIT.findall(text)
    run = {**about, "gpus": gpus, "lines": lines, "text": text,
           "ms": statistics.median(x[2] for x in kept) if kept else None,
           "tok_s": statistics.median(x[3] for x in kept) if kept else None,
           "mfu": median_mfu([x[4] for x in kept]), "val": val,
           "val_peak": {int(m[1]): float(m[3]) if m[3] else None for m in vals},
           "last_val": val[max(val)] if val else None,
           "peak": float(peak[1]) if peak else None,
           "exit": int(exits[-1]) if exits else None}
    script = plain_result(text) if about.get("tool") == "plain" else None
    if about.get("tool") == "plain":  # its figures in the monitor's terms
        run.update(ms=None, tok_s=None, mfu="n/a", peak=None)
    if script:
        run.update(ms=script["ms_per_step"], tok_s=script["tok_s_per_gpu"] * gpus,
                   mfu="n/a" if script["mfu_pct"] is None else f"{script['mfu_pct']}%",
                   peak=script.get("peak_mem_gib"))
    return run


def runs(out: Path) -> list[dict[str, Any]]:
    """Every harness log of OUT, in the order the plan ran them."""
    found = [read(p) for p in sorted(out.glob("*.log"))]
    return sorted((r for r in found if "section" in r), key=lambda r: r.get("index", 0))


def label(run: dict[str, Any]) -> str:
    """``fp8-delayed-te-attn``, ``plain:torch-compile``: the run's variant and its tool."""
    tool = run.get("tool", "fit")
    return run["variant"] if tool == "fit" else f"{tool}:{run['variant']}"


def layout(run: dict[str, Any]) -> str:
    return "1gpu" if run.get("strategy", "single") == "single" else \
        f"{run['strategy']}-{run['gpus']}gpu"


def family(run: dict[str, Any]) -> tuple[str, int]:
    """``ddp-bf16grad`` on 2 GPUs -> (``ddp``, 2): BF16 runs compared across their settings."""
    return run.get("strategy", "single").split("-")[0], run["gpus"]


def profile_rows(text: str) -> list[str]:
    """StepProfile's rows: rank, step, compute, exposed comm, GPU idle, comm (ms per step)."""
    at = text.find("profile: steps")
    return [f"rank {m[1]}: step {m[2]} = compute {m[3]} + exposed comm {m[4]} + idle {m[5]} "
            f"(comm {m[6]})" for m in PROFILE_ROW.finditer(text[at:at + 2000])] if at >= 0 else []


def per_gpu(run: dict[str, Any]) -> Optional[float]:
    return run["tok_s"] / run["gpus"] if run.get("tok_s") else None


def gpt_table(model: str, rows: list[dict[str, Any]]) -> list[str]:
    """One GPT model's table: every tool, variant and layout."""
    out = [f"\n{model}: tok/s per GPU (fit: median of the monitor's lines after the first two, "
           "before the profile; plain script: median of its 10-step windows); scaling = per GPU / "
           "the same run's 1 GPU; vs BF16 = over the fastest BF16 (package or plain script, any "
           "setting) of the same strategy and GPU count"]
    bf16: dict[tuple[str, int], float] = {}
    for r in rows:
        if not r.get("fp8") and per_gpu(r):
            bf16[family(r)] = max(bf16.get(family(r), 0.0), per_gpu(r))
    one = {label(r): per_gpu(r) for r in rows if layout(r) == "1gpu" and per_gpu(r)}
    width = max(len(label(r)) for r in rows) + 1
    ran = sorted((r for r in rows if per_gpu(r)), key=lambda r: (label(r), r["gpus"], layout(r)))
    for r in ran:
        scaling = (f"{per_gpu(r) / one[label(r)]:.2f}" if layout(r) != "1gpu" and label(r) in one
                   else "-")
        best = bf16.get(family(r))
        versus = f"{per_gpu(r) / best:.2f}x" if best else "-"
        out.append(f"  {label(r):<{width}} {layout(r):<22} {per_gpu(r):>10,.0f} per GPU  scaling "
                   f"{scaling:>5}  vs BF16 {versus:>6}  mfu {r['mfu']}")
    for r in rows:
        if not per_gpu(r):
            out.append(f"  {r['name']}: no step lines (see its log)")
    for r in rows:
        for row in profile_rows(r["text"]):
            out.append(f"      profile {r['name']}: {row}")
    return out


def llama_table(rows: list[dict[str, Any]]) -> list[str]:
    """The seed table: the speedup over the faster BF16 (package or plain script), the val loss
    against the package's BF16."""
    model = next((r["model"] for r in rows if r.get("model")), "llama")
    bf16 = {}  # GPU count -> the faster BF16 of that count
    for r in rows:
        if not r.get("fp8") and per_gpu(r):
            bf16[r.get("gpus")] = max(bf16.get(r.get("gpus"), 0), per_gpu(r))
    ref = next((r["last_val"] for r in rows if not r.get("fp8") and r.get("tool") == "fit"
                and r["last_val"] is not None), None)
    width = max([8] + [len(label(r)) for r in rows]) + 1
    out = [f"\n{model} table (FSDP2; s/it, tok/s per GPU and MFU: median of the monitor's lines "
           "after the first two (plain script: of its 10-step windows); peak: training, rank 0's "
           "GPU; val loss at the last step, against the package's BF16; speedup over the faster "
           "BF16)",
           f"  {'variant':<{width}} {'GPUs':>4} {'s/it':>7} {'tok/s/GPU':>10} {'speedup':>8} "
           f"{'mfu':>6} {'peak GiB':>9} {'val loss':>9} {'vs bf16':>8}"]
    for r in rows:
        if not per_gpu(r):
            out.append(f"  {label(r):<{width}} no step lines (see the log)")
            continue
        val = r["last_val"]
        gap = f"{100 * (val - ref) / ref:+.2f}%" if val is not None and ref else "-"
        speed = f"{per_gpu(r) / bf16[r.get('gpus')]:.2f}x" if bf16.get(r.get("gpus")) else "-"
        peak = "-" if r["peak"] is None else f"{r['peak']:.1f}"
        out.append(f"  {label(r):<{width}} {r['gpus']:>4} {r['ms'] / 1000:>7.3f} "
                   f"{per_gpu(r):>10,.0f} {speed:>8} {r['mfu']:>6} {peak:>9} "
                   f"{'-' if val is None else format(val, '.4f'):>9} {gap:>8}")
    return out


def eval_table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["\nevaluation inside FP8 runs (validation every 10 steps, 4 batches; peak GiB of each "
           "validation, training's peak, rank 0's GPU)"]
    for r in rows:
        vals = "; ".join(f"step {s}: val loss {v:.4f}, peak {r['val_peak'][s]} GiB"
                         for s, v in r["val"].items())
        peak = "-" if r["peak"] is None else f"{r['peak']:.1f}"
        out.append(f"  fp8_eval {r.get('fp8_eval')}: training peak {peak} GiB; "
                   f"{vals or 'no validation ran'}")
    return out


def resume_check(rows: list[dict[str, Any]]) -> list[str]:
    """The resumed run's loss gap to the uninterrupted one, beside two uninterrupted runs' gap
    (the run-to-run spread)."""
    by = {r.get("role"): {step: loss for step, loss, *_ in r["lines"] if loss is not None}
          for r in rows}
    a, b, c = by.get("whole"), by.get("resumed"), by.get("again")
    if not a or not b:
        return []

    def gap(x: dict[int, float]) -> tuple[list[int], str]:
        common = sorted(set(a) & set(x) & set(b))
        gaps = [abs(x[k] - a[k]) / a[k] for k in common]
        return common, (f"worst {max(gaps):.2e}, mean {sum(gaps) / len(gaps):.2e}" if gaps
                        else "-")

    common, gaps = gap(b)
    first = f"{abs(b[common[0]] - a[common[0]]) / a[common[0]]:.2e}" if common else "-"
    out = [f"\nresume from the sharded step-{common[0] - 1 if common else '?'} checkpoint: "
           f"{len(common)} steps compared ({common[0] if common else '-'}.."
           f"{common[-1] if common else '-'}); relative loss gap at the first {first}, {gaps}"]
    if c:
        out.append(f"      two uninterrupted runs over the same steps: relative gap {gap(c)[1]} "
                   "(the run-to-run spread)")
    resumed = next(r for r in rows if r.get("role") == "resumed")
    out += [f"      {m[0]}" for p in ("FP8 scaling state restored for \\d+ TE modules",
                                       "data: resumed at [^\\n]*")
            if (m := re.search(p, resumed["text"]))]
    return out


def throughput_llama(rows: list[dict[str, Any]]) -> list[str]:
    out = ["\nLlama throughput, FSDP2 (tok/s per GPU: median of the monitor's lines after the first "
           "two; scaling against the fewest GPUs of the variant)"]
    for variant in dict.fromkeys(label(r) for r in rows):
        mine = sorted((r for r in rows if label(r) == variant and per_gpu(r)),
                      key=lambda r: r["gpus"])
        for r in mine:
            bf16 = next((per_gpu(x) for x in rows if not x.get("fp8") and x["gpus"] == r["gpus"]
                         and per_gpu(x)), None)
            out.append(f"  {variant} {r['gpus']} GPUs: {r['ms'] / 1000:.3f} s/it, {per_gpu(r):,.0f} "
                       f"tok/s per GPU, scaling {per_gpu(r) / per_gpu(mine[0]):.3f} vs "
                       f"{mine[0]['gpus']} GPUs, mfu {r['mfu']}"
                       + (f", {per_gpu(r) / bf16:.2f}x BF16" if bf16 and r.get("fp8") else ""))
    return out


def probes(out_dir: Path, rows: list[dict[str, Any]]) -> list[str]:
    out = ["\nmemory probe (rank 0's live allocations at its first out-of-memory error)"]
    for r in rows:
        probe = out_dir / r["probe"]
        out.append(f"  {label(r)}: " + (probe.read_text().rstrip() if probe.exists()
                                        else "no out-of-memory error"))
    return out


def loss_check(rows: list[dict[str, Any]]) -> list[str]:
    """Val loss at the last validation of each loss run, against the one-GPU run's."""
    one = next((r for r in rows if r.get("strategy") == "single"), {})
    at = max(one.get("val") or {0: 0})
    ref = (one.get("val") or {}).get(at)
    out = [f"\nloss at step {at} (the same global batch on every layout, FP8 delayed; val loss; "
           "fsdp = FSDP2 with bfloat16 gathers)"]
    for r in rows:
        v = r["val"].get(at)
        gap = f"{100 * (v - ref) / ref:+.2f}%" if v is not None and ref else "-"
        out.append(f"  {r['name']:<26} {'-' if v is None else f'{v:.4f}':>8}  vs 1 GPU {gap}")
        for pattern in ("FP8 scaling state restored for \\d+ TE modules", "data: resumed at [^\\n]*",
                        "FP8 verified: [^\\n]*", f"sample \\(step {at}\\)[^\\n]{{0,80}}"):
            if m := re.search(pattern, r["text"]):
                out.append(f"      {m[0]}")
    return out


def bench_tables(out_dir: Path) -> list[str]:
    """bench's table per model, and doctor's predicted FP8 speedups against bench's."""
    out, benches = [], {}
    for path in sorted(out_dir.glob("bench-*/bench.json")):
        report = json.loads(path.read_text())
        name = path.parent.name.removeprefix("bench-")
        benches[name] = {r["variant"]: r for r in report["results"]}
        s = report["setup"]
        out.append(f"\n{name}: {s['model']} {s['n_layer']} layers, {s['batch_size']} x "
                   f"{s['seq_len']}, {report['env']['device']}, commit "
                   f"{report['env']['git_commit']}, speedup vs {report['baseline']}")
        for r in report["results"]:
            if r["status"] == "ran":
                mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
                mem = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"
                out.append(f"  {r['variant']:<32}{r['tokens_per_s']:>12,.0f} tok/s "
                           f"{r['ms_per_step']:>9.2f} ms MFU {mfu:>6} {mem:>7} GiB "
                           f"{r['speedup']:>6.2f}x")
            else:
                out.append(f"  {r['variant']:<32}{r['status']}: {r['reason'][:90]}")
    doctors = sorted(out_dir.glob("doctor-*.json"))
    if doctors:
        out.append("\ndoctor's prediction against bench (FP8 speedup over te-bf16):")
    for path in doctors:
        name = path.stem.removeprefix("doctor-")
        probe = json.loads(path.read_text()).get("probe") or {}
        measured = benches.get(name, {})
        for recipe, predicted in (probe.get("speedup") or {}).items():
            run, base = measured.get(f"fp8-{recipe}"), measured.get("te-bf16")
            if run and base and run["status"] == base["status"] == "ran":
                actual = base["ms_per_step"] / run["ms_per_step"]
                out.append(f"  {name:<12}{recipe:<9} predicted {predicted:.2f}x  measured "
                           f"{actual:.2f}x  error {100 * (predicted - actual) / actual:+.0f}%")
            else:
                out.append(f"  {name:<12}{recipe:<9} predicted {predicted:.2f}x  (no bench "
                           "measurement)")
    return out


def summarize(out_dir: Path) -> str:
    """Every table the logs and reports of ``out_dir`` make."""
    out_dir = Path(out_dir)
    device = out_dir / "gpu.txt"
    commit = out_dir / "commit.txt"
    lines = [f"device: {device.read_text().strip() if device.exists() else '?'}; commit "
             f"{commit.read_text().strip()[:12] if commit.exists() else '?'}"]
    found = runs(out_dir)
    sections: dict[str, list[dict[str, Any]]] = {}
    for r in found:
        sections.setdefault(r["section"], []).append(r)
    for section, rows in sections.items():
        if section in ("8b", "eval8b", "resume8b", "tp8b", "probe8b", "loss", "generate",
                       "bench", "doctor"):
            continue
        lines += gpt_table(section, rows)
    for section, make in (("8b", llama_table), ("eval8b", eval_table),
                          ("resume8b", resume_check), ("tp8b", throughput_llama),
                          ("loss", loss_check)):
        if section in sections:
            lines += make(sections[section])
    if "probe8b" in sections:
        lines += probes(out_dir, sections["probe8b"])
    for r in sections.get("generate", []):
        lines.append(f"\ngenerate (the consolidated checkpoint on one GPU): "
                     f"{r['text'].rstrip().splitlines()[-2] if r['exit'] == 0 else 'failed'}")
    lines += bench_tables(out_dir)
    failed = [p.stem for p in sorted(out_dir.glob("*.log"))
              if (codes := EXIT.findall(p.read_text(errors="replace"))) and codes[-1] != "0"]
    if failed:
        lines.append(f"\nruns that did not exit 0 (see their logs): {', '.join(failed)}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(Path(sys.argv[1] if len(sys.argv) > 1 else "bench_out")))
