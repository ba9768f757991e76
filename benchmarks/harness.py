"""The benchmark harness: the GPU runs behind docs/benchmarks.md, as named jobs.

    python -m benchmarks.harness JOB... [--gpus 1,2,4] [--variants V,...] [--strategies ddp,fsdp]
        [--steps N] [--sets 0 1 0,1 2,3] [--out DIR] [--timeout S] [--dry-run]

A job (benchmarks/jobs.py) is a list of runs: which tool (fit through the package CLI, the plain
PyTorch script, under torchrun on several GPUs, the Fabric example, bench, doctor), which variant
(fp8_lightning.measure.parse_variant's names: benchmarks/variants.py), which strategy, how many
GPUs, how many steps. --dry-run prints the plan.

Runs of one GPU count go at once, one per GPU set of --sets of that size, each set with its own
CUDA_VISIBLE_DEVICES and rendezvous port; without a set of their size they run one after the
other on the GPUs the harness sees. Each run writes OUT/NAME.log as it goes, under a time limit,
so a job stopped midway keeps every finished run's log. The summary (benchmarks/summary.py) ends
the call.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks.jobs import (BENCH_TIMEOUT, FIT_TIMEOUT, JOBS, PYTHON, TEXT, Plan, Run,
                             build_plan)
from benchmarks.variants import FSDP_GRAMMAR, ROOT, UsageError

# NVLink multicast stays off: it can take shared GPUs out of service.
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
       "NVSHMEM_DISABLE_NVLS": "1"}
BASE_PORT = 29600  # a GPU set's rendezvous port: BASE_PORT + 10 x its place in --sets
KILL_AFTER = 15.0  # seconds from a run's TERM to its KILL


# --------------------------------------------------------------------------------- scheduling
Slot = tuple[Run, Optional[str], Optional[int]]  # a run, its GPU set and port (None: inherited)


def waves(runs: list[Run], sets: tuple[str, ...]) -> list[list[Slot]]:
    """Runs that go at once: consecutive runs of one GPU count, one per set of that size (each
    set its own port), as many at a time as there are such sets; a run without a set of its
    size, a host command or a run marked ``alone`` goes alone."""
    out: list[list[Slot]] = []
    i = 0
    while i < len(runs):
        run = runs[i]
        fitting = [(k, s) for k, s in enumerate(sets) if len(s.split(",")) == run.gpus]
        group = [run]
        i += 1
        if run.gpus and not run.alone and fitting:
            while i < len(runs) and runs[i].gpus == run.gpus and not runs[i].alone:
                group.append(runs[i])
                i += 1
        for start in range(0, len(group), max(1, len(fitting))):
            chunk = group[start:start + max(1, len(fitting))]
            if run.gpus and fitting:
                out.append([(r, s, BASE_PORT + 10 * k) for r, (k, s) in zip(chunk, fitting)])
            else:
                out.append([(r, None, None) for r in chunk])
    return out


def describe(plan: Plan) -> str:
    """The plan as the dry run prints it: each wave's runs with their GPUs, port, time limit and
    command."""
    lines = [f"out: {plan.out}; files written there first: {', '.join(plan.files) or 'none'}"]
    for number, wave in enumerate(waves(plan.runs, plan.sets), 1):
        lines.append(f"wave {number}:")
        for run, gpu_set, port in wave:
            where = (f"CUDA_VISIBLE_DEVICES={gpu_set} MASTER_PORT={port} " if gpu_set else "")
            env = "".join(f"{k}={shlex.quote(v)} " for k, v in run.env.items())
            skip = f" (skipped if {run.done_if} exists)" if run.done_if else ""
            lines.append(f"  {run.name} [{run.gpus} GPU(s), {run.timeout:.0f} s]{skip}: "
                         f"{where}{env}{shlex.join(run.argv)}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------- execution
def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        Path(path).unlink(missing_ok=True)


def physical(gpu_set: str, inherited: Optional[str]) -> str:
    """A set's GPUs as this process's CUDA_VISIBLE_DEVICES names them: the set's indices count
    the GPUs the harness sees."""
    if not inherited:
        return gpu_set
    seen = inherited.split(",")
    try:
        return ",".join(seen[int(i)] for i in gpu_set.split(","))
    except IndexError:
        raise UsageError(f"--sets {gpu_set}: only {len(seen)} GPUs visible "
                         f"(CUDA_VISIBLE_DEVICES={inherited})") from None


class Running:
    """A started run: its process group, log and deadline."""

    def __init__(self, run: Run, gpu_set: Optional[str], port: Optional[int], out: Path) -> None:
        self.run, self.start = run, time.monotonic()
        env = dict(os.environ, **run.env)
        if gpu_set is not None:
            env.update(CUDA_VISIBLE_DEVICES=physical(gpu_set, os.environ.get(
                "CUDA_VISIBLE_DEVICES")), MASTER_PORT=str(port), PET_MASTER_PORT=str(port))
        for path in run.fresh:
            remove(path)
        self.path = out / f"{run.name}.log"
        self.log = open(self.path, "w")
        where = f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} " if gpu_set else ""
        self.log.write(f"=== run {json.dumps({'name': run.name, **run.about})}\n"
                       f"=== command: {where}"
                       f"{shlex.join(run.argv)}\n")
        self.log.flush()
        print(f"=== {run.name}: {run.gpus} GPU(s) {where}".rstrip(), flush=True)
        # its own process group (the ranks in it): a timeout or a stop ends them all
        self.proc = subprocess.Popen(run.argv, cwd=ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.deadline = self.start + run.timeout
        self.termed: Optional[float] = None  # when its group was sent TERM
        self.code: Optional[int] = None

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def end(self) -> None:
        """TERM to the run's group now (KILL follows after KILL_AFTER seconds)."""
        if self.termed is None:
            self.termed = time.monotonic()
            self.signal(signal.SIGTERM)

    def poll(self) -> bool:
        """True once the run has ended: its status and time appended to its log."""
        now = time.monotonic()
        if self.proc.poll() is None:
            if now >= self.deadline:
                self.end()
            if self.termed is not None and now >= self.termed + KILL_AFTER:
                self.signal(signal.SIGKILL)
            return False
        if self.code is None:
            self.code = 124 if self.termed is not None else self.proc.returncode
            self.signal(signal.SIGKILL)  # whatever of its group outlived it
            line = f"=== {self.run.name}: exit {self.code} after {now - self.start:.0f} s"
            self.log.write(line + "\n")
            self.log.close()
            print(line, flush=True)
            for text in [x for x in self.path.read_text(errors="replace").splitlines()
                         if "Error" in x or "error:" in x][:3]:
                print(f"    {text[:200]}", flush=True)
            for path in self.run.clean:
                remove(path)
        return True


def why_not(run: Run, visible: int) -> Optional[str]:
    """Why ``run`` is not to go (None: it goes)."""
    if run.done_if and glob.glob(run.done_if):
        return f"done already ({run.done_if})"
    if run.gpus > visible:
        return f"needs {run.gpus} GPUs, {visible} visible"
    for path in run.needs:
        if not os.path.exists(path):
            return f"{path} is missing (an earlier step failed)"
    return None


def execute(plan: Plan, visible: int, poll: float = 0.5) -> int:
    """Run the plan's waves in order. A TERM or INT ends every started run's group (TERM, then
    KILL) and closes its log before the harness returns 143; else 0."""
    plan.out.mkdir(parents=True, exist_ok=True)
    for name, text in plan.files.items():
        (plan.out / name).write_text(text)
    stop: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: stop.append(signum))
           for s in (signal.SIGTERM, signal.SIGINT)}
    running: list[Running] = []
    try:
        for wave in waves(plan.runs, plan.sets):
            for run, gpu_set, port in wave:
                reason = "stopped" if stop else why_not(run, visible)
                if reason:  # (what it would have cleaned up goes all the same)
                    print(f"=== {run.name}: not run: {reason}", flush=True)
                    for path in run.clean:
                        remove(path)
                    continue
                running.append(Running(run, gpu_set, port, plan.out))
            while running:
                if stop:
                    for r in running:
                        r.end()
                running = [r for r in running if not r.poll()]
                if running:
                    time.sleep(poll)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return 143 if stop else 0


def record_machine(out: Path) -> None:
    """OUT/gpu.txt (the GPUs and driver) and OUT/commit.txt (the tree measured)."""
    for name, argv in (("gpu.txt", ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                    "--format=csv,noheader"]),
                       ("commit.txt", ["git", "-C", str(ROOT), "rev-parse", "HEAD"])):
        try:
            text = subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            text = ""
        (out / name).write_text(text)


def visible_gpus() -> int:
    """The GPUs the runs will see (asked in a process of its own: this one stays off CUDA)."""
    found = subprocess.run([*PYTHON, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True)
    return int(found.stdout.strip() or 0) if found.returncode == 0 else 0


# --------------------------------------------------------------------------------- CLI
def comma_list(kind: Callable[[str], Any]) -> Callable[[str], tuple]:
    return lambda text: tuple(kind(x) for x in text.split(",") if x)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.harness",
        description="\n\n".join(__doc__.split("\n\n")[2:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="jobs:\n" + "\n".join(f"  {name:<20} {job.doc}" for name, job in JOBS.items()))
    p.add_argument("jobs", nargs="+", metavar="JOB", help="jobs to run, in order (below)")
    p.add_argument("--gpus", type=comma_list(int), help="GPU counts (e.g. 1,2,4: 1 is the "
                   "one-GPU runs; loss and Llama jobs: the count of their several-GPU runs)")
    p.add_argument("--variants", type=comma_list(str), help="[plain:|fabric:]VARIANT,... "
                   "(fp8_lightning.measure.parse_variant's names)")
    p.add_argument("--strategies", type=comma_list(str),
                   help=f"ddp[-bf16grad][-bN], {FSDP_GRAMMAR}")
    p.add_argument("--steps", type=int, help="training (bench: timed) steps of each run")
    p.add_argument("--plain-steps", type=int, help="table-8b's plain-script rows (default 60)")
    p.add_argument("--warmup", type=int, help="bench's untimed steps (default 5)")
    p.add_argument("--profile-at", type=int, help="StepProfile's first step (default: steps - 10)")
    p.add_argument("--sets", nargs="+", metavar="SET", help="GPU sets runs go on at once (0 1 "
                   "for one-GPU runs, 0,1 2,3 for two-GPU runs); table jobs default to 0 1")
    p.add_argument("--out", default="bench_out", help="logs, summary (default bench_out)")
    p.add_argument("--timeout", type=float, help=f"seconds per run (default {FIT_TIMEOUT:.0f}; "
                   f"bench and doctor {BENCH_TIMEOUT:.0f})")
    p.add_argument("--max-mb", type=float, default=100, help="the corpus's MB of Python "
                   f"sources (read when {TEXT} is first made)")
    p.add_argument("--data", default="/tmp/pycode-ds", help="the corpus in 1024-token blocks")
    p.add_argument("--data8k", default="/tmp/pycode-ds-8k", help="... in 8192-token blocks")
    p.add_argument("--llama", choices=("8b", "3b"), default="8b", help="the Llama jobs' model")
    p.add_argument("--layers", type=int, help="cut the Llama and bench models to N layers")
    p.add_argument("--extra", help="overrides appended to table-8b's fits and to bench and "
                   "doctor (quoted, --extra='--a b')")
    p.add_argument("--fp8-eval", type=comma_list(str), help="eval-8b's fp8_eval values "
                   "(default false,true)")
    p.add_argument("--resume-at", type=int, default=10, help="resume-8b's checkpoint step")
    p.add_argument("--resume-to", type=int, default=19, help="resume-8b's last step")
    p.add_argument("--ckpt-root", default="/tmp/harness_8b", help="resume-8b's checkpoint "
                   "(on disk; deleted after)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    opts = parser().parse_args(argv)
    os.environ.update(ENV)
    # the runs import the checkout's packages (benchmarks, examples) from the repository root
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    try:
        plan = build_plan(opts)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if opts.dry_run:
        print(describe(plan))
        return 0
    visible = visible_gpus()
    fits = [max(int(i) for i in s.split(",")) < visible for s in plan.sets]
    if not opts.sets:  # a job's default sets: those this machine has
        plan.sets = tuple(s for s, fit in zip(plan.sets, fits) if fit)
    elif not all(fits):
        print(f"error: --sets {' '.join(opts.sets)}: {visible} GPU(s) visible", file=sys.stderr)
        return 2
    plan.out.mkdir(parents=True, exist_ok=True)
    record_machine(plan.out)
    code = execute(plan, visible)
    for path in sorted(plan.out.rglob("*.ckpt")):  # checkpoints are large; the logs stay
        remove(str(path))
    from benchmarks.summary import summarize

    try:
        text = summarize(plan.out)
    except Exception as err:  # noqa: BLE001 - the logs are kept; the summary can be rerun
        text = f"summary failed ({type(err).__name__}: {err}): python -m benchmarks.summary OUT"
    print(text)
    (plan.out / "summary.txt").write_text(text + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
