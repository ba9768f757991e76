"""Summarise ``multi_gpu.sh`` logs: tok/s per strategy and GPU count (median of the monitor's
lines after the first two and before StepProfile's steps), scaling against one GPU, and the
loss/resume checks; the 8B table, evaluation, resume, scaling and throughput runs (``t8-``, ``e8-``, ``r8-``, ``s8-``, ``m8-``,
``tp8-`` logs).

Usage: ``python scripts/multi_gpu_summary.py OUT_DIR``
"""

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Optional

LINE = re.compile(r"step (\d+) \| loss ([\d.]+|nan|inf) .*\| dt ([\d.]+)ms \| tok/s ([\d,]+) \| "
                  r"mfu ([\d.]+%|n/a)")
VAL = re.compile(r"step (\d+) \| val/loss ([\d.]+)[^\n]*?(?:\| peak mem ([\d.]+) GiB[^\n]*)?$",
                 re.M)
# examples/fabric_train.py's line (tok/s per GPU, no MFU)
FABRIC_LINE = re.compile(r"step +(\d+) \| loss ([\d.]+|nan|inf) \| lr \S+ \| (\d+) ms/step \| "
                         r"tok/s per GPU ([\d,]+)")
MEMORY = re.compile(r"memory: peak ([\d.]+) GiB in training")
ESTIMATE = re.compile(r"memory: estimated ([\d.]+) GiB per GPU")
PROFILED = re.compile(r"profile: steps (\d+)-(\d+)")
DEVICES = re.compile(r"=== devices: (\d+)")


def median_mfu(values: list[str]) -> Optional[str]:
    """The median of the monitor's MFU fields ("45.4%", or "n/a" where unknown), as printed."""
    known = sorted((v for v in values if v.endswith("%")), key=lambda v: float(v[:-1]))
    return known[(len(known) - 1) // 2] if known else (values[0] if values else None)


def read(log: Path) -> dict:
    """One run's log: its monitor lines (steady: after the first two), validations and memory."""
    text = log.read_text(errors="replace")
    lines = [(int(m[1]), float(m[2]), float(m[3]), float(m[4].replace(",", "")), m[5])
             for m in LINE.finditer(text)]
    devices = DEVICES.search(text)
    gpus = int(devices[1]) if devices else 1
    if not lines:  # the Fabric example's lines: tok/s per GPU, made the run's like the monitor's
        lines = [(int(m[1]), float(m[2]), float(m[3]), gpus * float(m[4].replace(",", "")), "n/a")
                 for m in FABRIC_LINE.finditer(text)]
    kept = lines[2:] or lines
    profiled = PROFILED.search(text)
    if profiled:  # keep the lines whose window (previous line's step, step] ends before the
        # profiled steps (monitor steps A+1..): the profiled ones run slower, and every step after
        # them stays slower where the host sets the pace, because Kineto leaves CUPTI attached
        # after the profiler exits (pytorch/pytorch#144455; docs/benchmarks.md, Method); graph
        # replays and GPU-bound steps do not move
        first = int(profiled[1]) + 1
        kept = [x for x in kept if x[0] < first] or kept
    peak = MEMORY.search(text)
    vals = list(VAL.finditer(text))
    val = {int(m[1]): float(m[2]) for m in vals}
    return {"lines": lines, "ms": statistics.median(x[2] for x in kept) if kept else None,
            "tok_s": statistics.median(x[3] for x in kept) if kept else None,
            "mfu": median_mfu([x[4] for x in kept]), "val": val,
            "val_peak": {int(m[1]): float(m[3]) if m[3] else None for m in vals},
            "last_val": val[max(val)] if val else None,
            "peak": float(peak[1]) if peak else None, "gpus": gpus,
            "estimate": float(estimate[1]) if (estimate := ESTIMATE.search(text)) else None,
            "text": text}


def main8b(out: Path) -> None:
    runs = {p.stem.removeprefix("t8-"): read(p) for p in sorted(out.glob("t8-*.log"))}
    script = plain(out / "t8-plain-bf16.log") if "plain-bf16" in runs else None
    if script:  # benchmarks/plain_pytorch.py's figures, in the monitor's terms (tok/s of the run)
        mfu = "n/a" if script["mfu_pct"] is None else f"{script['mfu_pct']}%"
        runs["plain-bf16"].update(ms=script["ms_per_step"], mfu=mfu,
                                  tok_s=script["tok_s_per_gpu"] * script["gpus"],
                                  gpus=script["gpus"], peak=script["peak_mem_gib"])
    if runs:
        # the baseline: the faster BF16 of the package and the plain script
        bf16 = max((runs[k] for k in ("bf16", "plain-bf16") if runs.get(k, {}).get("tok_s")),
                   key=lambda r: r["tok_s"] / r["gpus"], default={})
        print("\n8B table (FSDP2; s/it, tok/s per GPU and MFU: median of the monitor's lines after"
              " the first two (plain-bf16: of its 10-step windows); peak: training, rank 0's GPU;"
              " val loss at the last step, against the package's BF16; speedup over the faster BF16)")
        print(f"  {'variant':<22} {'s/it':>7} {'tok/s/GPU':>10} {'speedup':>8} {'mfu':>6} "
              f"{'peak GiB':>9} {'val loss':>9} {'vs bf16':>8}")
        for name, r in runs.items():
            if r["tok_s"] is None:
                print(f"  {name:<22} no step lines (see the log)")
                continue
            val, ref = r["last_val"], runs.get("bf16", {}).get("last_val")
            gap = f"{100 * (val - ref) / ref:+.2f}%" if val is not None and ref else "-"
            speed = (f"{r['tok_s'] / r['gpus'] / (bf16['tok_s'] / bf16['gpus']):.2f}x"
                     if bf16.get("tok_s") else "-")
            print(f"  {name:<22} {r['ms'] / 1000:>7.3f} {r['tok_s'] / r['gpus']:>10,.0f} {speed:>8} "
                  f"{r['mfu']:>6} {'-' if r['peak'] is None else format(r['peak'], '.1f'):>9} "
                  f"{'-' if val is None else format(val, '.4f'):>9} {gap:>8}")
    evals = {p.stem.removeprefix("e8-"): read(p) for p in sorted(out.glob("e8-*.log"))}
    if evals:
        print("\n8B evaluation inside FP8 delayed runs (validation every 10 steps, 4 batches; "
              "peak GiB of each validation, training's peak, rank 0's GPU)")
        for name, r in evals.items():
            vals = "; ".join(f"step {s}: val loss {v:.4f}, peak {p} GiB"
                             for s, v in r["val"].items() for p in [r["val_peak"][s]])
            peak = "-" if r["peak"] is None else f"{r['peak']:.1f}"
            print(f"  {name:<18} training peak {peak} GiB; {vals or 'no validation ran'}")
    whole, resumed, again = (out / f"r8-{name}.log" for name in ("whole", "resumed", "again"))
    if whole.exists() and resumed.exists():
        a = {step: loss for step, loss, *_ in read(whole)["lines"]}
        b = {step: loss for step, loss, *_ in read(resumed)["lines"]}
        c = {step: loss for step, loss, *_ in read(again)["lines"]} if again.exists() else {}

        def gap(x: dict) -> tuple[list[int], str]:
            """The steps compared and the worst / mean relative gap to the whole run over them."""
            common = sorted(set(a) & set(x) & set(b))
            gaps = [abs(x[k] - a[k]) / a[k] for k in common]
            return common, (f"worst {max(gaps):.2e}, mean {sum(gaps) / len(gaps):.2e}"
                            if gaps else "-")

        common, gaps = gap(b)
        first = f"{abs(b[common[0]] - a[common[0]]) / a[common[0]]:.2e}" if common else "-"
        at = common[0] - 1 if common else "?"
        print(f"\n8B resume from the sharded step-{at} checkpoint: {len(common)} steps compared "
              f"({common[0] if common else '-'}..{common[-1] if common else '-'}); relative loss "
              f"gap at the first {first}, {gaps}")
        if c:
            print(f"      two uninterrupted runs over the same steps: relative gap {gap(c)[1]} "
                  "(the run-to-run spread)")
        for pattern in ("FP8 scaling state restored for \\d+ TE modules", "data: resumed at [^\\n]*"):
            if m := re.search(pattern, resumed.read_text(errors="replace")):
                print(f"      {m[0]}")
    tp8 = {p.stem.removeprefix("tp8-"): read(p) for p in sorted(out.glob("tp8-*.log"))}
    if tp8:
        print("\n8B throughput, FSDP2, 1 x 8192 per GPU (tok/s per GPU: median of the monitor's lines"
              " after the first two; scaling against the fewest GPUs of the variant)")
        for variant in sorted({name.rsplit("-", 1)[0] for name in tp8}):
            rows = sorted((r["gpus"], r) for name, r in tp8.items()
                          if name.rsplit("-", 1)[0] == variant and r["tok_s"])
            for gpus, r in rows:
                per = r["tok_s"] / gpus
                base = rows[0][1]["tok_s"] / rows[0][0]
                bf16 = tp8.get(f"bf16-{gpus}gpu", {}).get("tok_s")
                print(f"  {variant:<14} {gpus} GPUs: {r['ms'] / 1000:.3f} s/it, {per:,.0f} tok/s per "
                      f"GPU, scaling {per / base:.3f} vs {rows[0][0]} GPUs, mfu {r['mfu']}"
                      + (f", {r['tok_s'] / bf16:.2f}x BF16" if bf16 else ""))
    scaling = {p.stem.removeprefix("s8-"): read(p) for p in sorted(out.glob("s8-*.log"))}
    if scaling:
        print("\n8B-shape scaling, FSDP2, FP8 delayed, 1 x 8192 per GPU (efficiency = tok/s per GPU"
              " / one GPU's)")
        for layers in (4, 8):
            one = scaling.get(f"l{layers}-1gpu", {})
            for name, r in scaling.items():
                if name.startswith(f"l{layers}-") and r.get("tok_s"):
                    eff = (f"{r['tok_s'] / r['gpus'] / one['tok_s']:.3f}" if one.get("tok_s")
                           else "-")
                    print(f"  {layers} layers, {r['gpus']} GPU(s): {r['ms']:.1f} ms/step, "
                          f"{r['tok_s'] / r['gpus']:,.0f} tok/s per GPU, efficiency {eff}")
        t4, t8 = (scaling.get(f"l{n}-1gpu", {}).get("ms") for n in (4, 8))
        full = runs.get("fp8-delayed", {})
        if t4 and t8 and full.get("ms"):
            one32 = t4 + (t8 - t4) / 4 * 28  # ms per step (1 x 8192) at 32 layers, one GPU
            print(f"  32 layers: one GPU (extrapolated) {one32:.0f} ms/step; {full['gpus']} GPUs "
                  f"(t8-fp8-delayed) {full['ms']:.0f} ms/step: efficiency {one32 / full['ms']:.3f}")


def memory8b(out: Path) -> None:
    """memory-8b: the estimate against the measured training peak at 4 and 8 layers, and what a
    block adds to each (the 8-layer run less the 4-layer one, over 4)."""
    runs = {p.stem.removeprefix("m8-"): read(p) for p in sorted(out.glob("m8-*.log"))}
    if not runs:
        return
    print("\n8B-shape memory, FSDP2, FP8 delayed, 1 x 8192 per GPU (GiB, rank 0's GPU: the check's"
          " estimate against the training peak)")
    for ac in dict.fromkeys(name.rsplit("-l", 1)[0] for name in runs):
        est, peak = {}, {}
        for layers in (4, 8):
            r = runs.get(f"{ac}-l{layers}", {})
            est[layers], peak[layers] = r.get("estimate"), r.get("peak")
            ratio = (f"{est[layers] / peak[layers]:.2f}x" if est[layers] and peak[layers]
                     else "-")
            print(f"  {ac:<5} {layers} layers: estimate {est[layers] or '-'}, peak "
                  f"{peak[layers] or '-'} ({ratio})")
        if all(est.values()) and all(peak.values()):
            print(f"  {ac:<5} a block: estimate {(est[8] - est[4]) / 4:.2f}, measured "
                  f"{(peak[8] - peak[4]) / 4:.2f}")


# variant, layout (1gpu, or strategy-Ngpu: ddp, ddp-bf16grad, fsdp, fsdp-keep-g4-eager, ...)
NAME = re.compile(r"^(.+?)-(1gpu|(?:ddp|fsdp)(?:-[a-z0-9]+)*-\d+gpu)$")
PROFILE_ROW = re.compile(r"^(\d+) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+)", re.M)


def plain(log: Path) -> Optional[dict]:
    """benchmarks/plain_pytorch.py's JSON line."""
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except json.JSONDecodeError:  # (another line that starts with a brace)
                continue
            if isinstance(result, dict) and result.get("script") == "plain_pytorch":
                return result
    return None


def profile_rows(text: str) -> list[str]:
    """StepProfile's rows: rank, step, compute, exposed comm, GPU idle, comm (ms per step)."""
    at = text.find("profile: steps")
    return [f"rank {m[1]}: step {m[2]} = compute {m[3]} + exposed comm {m[4]} + idle {m[5]} "
            f"(comm {m[6]})" for m in PROFILE_ROW.finditer(text[at:at + 2000])] if at >= 0 else []


def family(layout: str) -> tuple[str, str]:
    """``ddp-bf16grad-2gpu`` -> (``ddp``, ``2gpu``): BF16 runs compared across their settings."""
    parts = layout.split("-")
    return parts[0], parts[-1]


def main(out: Path) -> None:
    print(f"device: {(out / 'gpu.txt').read_text().strip() if (out / 'gpu.txt').exists() else '?'}; "
          f"commit {(out / 'commit.txt').read_text().strip()[:7] if (out / 'commit.txt').exists() else '?'}")
    for model in ("gpt2", "gpt-1.3b"):
        runs = {p.stem.removeprefix(f"tp-{model}-"): read(p)
                for p in out.glob(f"tp-{model}-*gpu.log")}
        runs.update({"fabric-fp8-" + p.stem.removeprefix(f"fabric-{model}-"): read(p)
                     for p in out.glob(f"fabric-{model}-*gpu.log")})
        scripts = {p.stem.removeprefix(f"plain-{model}-"): plain(p)
                   for p in out.glob(f"plain-{model}-*gpu.log")}
        if not runs and not scripts:
            continue
        print(f"\n{model}: tok/s per GPU (median of the monitor's lines after the first two, before the profile; the "
              "plain script: median of 10-step windows); scaling = per GPU / the same run's 1 GPU; "
              "vs BF16 = over the fastest BF16 (package or plain script, any setting) of the same strategy "
              "and GPU count")
        bf16 = {}  # (strategy, GPUs) -> the fastest BF16 tok/s per GPU of any of its settings
        for layout, r in scripts.items():
            if r:
                key = family(layout)
                bf16[key] = max(bf16.get(key, 0), r["tok_s_per_gpu"])
        for name, r in runs.items():
            if name.startswith("bf16-") and r["tok_s"]:
                key = family(name.removeprefix("bf16-"))
                bf16[key] = max(bf16.get(key, 0), r["tok_s"] / r["gpus"])
        rows = [(f"plain-{k}", v["tok_s_per_gpu"], v["mfu_pct"]) for k, v in scripts.items() if v]
        rows += [(k, r["tok_s"] / r["gpus"], r["mfu"]) for k, r in runs.items() if r["tok_s"]]
        split = {name: NAME.match(name).groups() for name, *_ in rows}  # (variant, layout)
        one = {split[name][0]: per_gpu for name, per_gpu, _ in rows if split[name][1] == "1gpu"}
        for name, per_gpu, mfu in sorted(rows, key=lambda x: (split[x[0]][0], split[x[0]][1])):
            variant, layout = split[name]
            scaling = (f"{per_gpu / one[variant]:.2f}" if layout != "1gpu" and one.get(variant)
                       else "-")
            best = bf16.get(family(layout))
            versus = f"{per_gpu / best:.2f}x" if best else "-"
            print(f"  {variant:<16} {layout:<10} {per_gpu:>10,.0f} per GPU  scaling {scaling:>5}  "
                  f"vs BF16 {versus:>6}  mfu {mfu}")
        failed = sorted([f"tp-{k}" for k, r in runs.items() if not r["tok_s"]]
                        + [f"plain-{k}" for k, v in scripts.items() if not v])
        for name in failed:
            print(f"  {name}: no step lines (see its log)")
        for name, r in sorted(runs.items()):
            for row in profile_rows(r["text"]):
                print(f"      profile {name}: {row}")
    main8b(out)
    memory8b(out)
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
