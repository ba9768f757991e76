"""The jobs (:data:`JOBS`): named lists of runs (which tool, variant, strategy, GPUs, steps),
and the plan (:func:`build_plan`) that turns them into commands under one call's options."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.variants import (UsageError, check_variant, plugin_overrides, split_tool,
                                 strategy_overrides, variant_overrides)

FIT_TIMEOUT = 420.0
BENCH_TIMEOUT = 240.0
HOST_TIMEOUT = 3600.0  # corpus preparation and checkpoint tools
TEXT = "/tmp/pycode-txt"  # the real-text corpus's text, once per machine
PLAIN_STRATEGIES = ("ddp", "ddp-bf16grad", "fsdp", "fsdp-keep", "fsdp-whole")  # plain_pytorch.py's


# --------------------------------------------------------------------------------- jobs
@dataclass(frozen=True)
class Row:
    """One run of a job: ``tool:variant`` (no tool: ``fit``) on ``gpus`` GPUs under ``strategy``
    (``single`` on one GPU)."""

    variant: str
    strategy: str = "single"
    gpus: int = 1


@dataclass(frozen=True)
class Job:
    """A named job. ``rows``: its fixed runs; else ``variants`` x (one GPU, and each of
    ``strategies`` on each count of ``gpus`` above one). ``kind`` picks how a row becomes a
    command; ``takes`` the options it reads (the others are left to the other jobs of a call)."""

    kind: str
    doc: str
    model: str = ""
    batch: int = 0
    rows: tuple[Row, ...] = ()
    variants: tuple[str, ...] = ()
    strategies: tuple[str, ...] = ()
    gpus: tuple[int, ...] = ()
    steps: int = 0
    seq_len: int = 0  # bench and doctor
    layers: int = 0  # bench and doctor: the model cut to this depth (0: the preset's)
    sets: tuple[str, ...] = ()  # the GPU sets without --sets
    takes: frozenset = frozenset()


FP8 = "fp8-delayed-te-attn"  # configs/gpt2_fp8.yaml as shipped
BF16 = "torch-compile"  # configs/gpt2_bf16.yaml as shipped
TENSORWISE = "fp8-tensorwise"
PLAIN = f"plain:{BF16}"
FABRIC = "fabric:fp8-delayed"  # examples/fabric_train.py: TE delayed, SDPA, compiled
# FP8 delayed in every block and BF16, both recomputing the MLPs (configs/llama3_8b_*.yaml's
# checkpointing; the 8B FP8 config keeps its first and last block BF16: -bf16ends)
L_FP8 = "fp8-delayed-te-attn-ac-mlp"
L_BF16 = "torch-compile-ac-mlp"


def table(one: tuple[str, ...], two: tuple[tuple[str, str], ...]) -> tuple[Row, ...]:
    """A several-GPU table: ``one`` on one GPU, then ``two`` ((variant, strategy)) on two."""
    return tuple(Row(v) for v in one) + tuple(Row(v, s, 2) for v, s in two)


TABLE_TAKES = frozenset({"gpus", "steps", "profile_at"})
GRID_TAKES = frozenset({"gpus", "variants", "strategies", "steps", "profile_at"})
LLAMA_TAKES = frozenset({"gpus", "variants", "steps", "layers"})
BENCH_VARIANTS = ("torch-compile", "te-bf16", "fp8-delayed", "fp8-current", "fp8-block",
                  "fp8-mxfp8", "fp8-delayed-te-attn", "fp8-delayed-nograph",
                  "fp8-delayed-bf16ends")


def bench_job(model: str, batch: int, seq_len: int, layers: int = 0, kind: str = "bench") -> Job:
    """bench's variants of a model on one GPU, or doctor's prediction at the same micro-batch."""
    what = "bench's variants of" if kind == "bench" else "doctor's FP8 prediction for"
    return Job(kind, f"{what} {model}, {batch} x {seq_len}"
               + (f", cut to {layers} layers" if layers else "") + ", one GPU", model, batch,
               variants=BENCH_VARIANTS if kind == "bench" else (), steps=15, seq_len=seq_len,
               layers=layers, takes=frozenset({"variants", "steps", "warmup", "layers", "extra"}
                                              if kind == "bench" else {"layers", "extra"}))


JOBS: dict[str, Job] = {
    # docs/benchmarks.md's two-GPU tables: one-GPU runs two at a time by default
    "table-gpt2": Job("gpt", "the GPT-2 124M table: one GPU, then two (DDP, FSDP2)", "gpt2", 16,
                      table((PLAIN, FP8, BF16, FABRIC),
                            ((PLAIN, "ddp"), (PLAIN, "fsdp"), (BF16, "ddp"), (BF16, "fsdp"),
                             (FP8, "ddp"), (FP8, "fsdp"), (TENSORWISE, "fsdp"), (FABRIC, "ddp"),
                             (FABRIC, "fsdp"))),
                      gpus=(1, 2), steps=120, sets=("0", "1"), takes=TABLE_TAKES),
    "table-gpt-1.3b": Job("gpt", "the 1.3B table: one GPU, then two (DDP, FSDP2)", "gpt-1.3b", 8,
                          table((PLAIN, FP8, BF16),
                                ((PLAIN, "ddp"), (PLAIN, "fsdp"), (BF16, "ddp"), (BF16, "fsdp"),
                                 (FP8, "ddp"), (FP8, "fsdp"), (TENSORWISE, "fsdp"))),
                          gpus=(1, 2), steps=120, sets=("0", "1"), takes=TABLE_TAKES),
    "table-gpt-1.3b-ddp": Job("gpt", "the 1.3B table's one-GPU and DDP rows", "gpt-1.3b", 8,
                              table((PLAIN, FP8, BF16),
                                    ((PLAIN, "ddp"), (BF16, "ddp"), (FP8, "ddp"))),
                              gpus=(1, 2), steps=120, sets=("0", "1"), takes=TABLE_TAKES),
    "table-gpt-1.3b-fsdp": Job("gpt", "the 1.3B table's FSDP2 rows (and one GPU's plain and FP8)",
                               "gpt-1.3b", 8,
                               table((PLAIN, FP8),
                                     ((PLAIN, "fsdp"), (BF16, "fsdp"), (FP8, "fsdp"),
                                      (TENSORWISE, "fsdp"))),
                               gpus=(1, 2), steps=120, sets=("0", "1"), takes=TABLE_TAKES),
    "throughput-gpt2": Job("gpt", "fit's tok/s per variant on one GPU, then each strategy on "
                           "each GPU count", "gpt2", 16, variants=(FP8, BF16),
                           strategies=("ddp", "fsdp"), gpus=(1, 2, 4), steps=120, takes=GRID_TAKES),
    "throughput-gpt-1.3b": Job("gpt", "as throughput-gpt2, the 1.3B GPT", "gpt-1.3b", 8,
                               variants=(FP8, BF16), strategies=("ddp", "fsdp"), gpus=(1, 2, 4),
                               steps=120, takes=GRID_TAKES),
    "plain-gpt2": Job("gpt", "benchmarks/plain_pytorch.py on one GPU, then each strategy on each "
                      "GPU count", "gpt2", 16, variants=(PLAIN,), strategies=("ddp", "fsdp"),
                      gpus=(1, 2, 4), steps=120, takes=GRID_TAKES - {"variants"}),
    "plain-gpt-1.3b": Job("gpt", "as plain-gpt2, the 1.3B GPT", "gpt-1.3b", 8, variants=(PLAIN,),
                          strategies=("ddp", "fsdp"), gpus=(1, 2, 4), steps=120,
                          takes=GRID_TAKES - {"variants"}),
    "loss-gpt2": Job("loss", "200 steps at a global batch of 32 x 1024: one GPU reading the "
                     "ranks' samples, DDP and FSDP2 on --gpus (4); then resume-gpt2", "gpt2",
                     gpus=(4,), takes=frozenset({"gpus"})),
    "resume-gpt2": Job("resume", "loss-gpt2's FSDP2 run, resumed from its step-100 sharded "
                       "checkpoint, consolidated and sampled on one GPU", "gpt2", gpus=(4,),
                       takes=frozenset({"gpus"})),
    # the Llama jobs: configs/llama3_{8b,3b}_{bf16,fp8}.yaml (FSDP2), the corpus in 8192 blocks
    "table-8b": Job("llama", "the seed table: each variant at the same global batch, one seed, "
                    "val loss (4 batches) at the last step", variants=(
                        L_BF16, f"plain:{L_BF16}", L_FP8, "fp8-delayed-bf16ends-te-attn-ac-mlp",
                        "fp8-current-te-attn-ac-mlp", "fp8-block-te-attn-ac-mlp",
                        "fp8-current-bf16ends-te-attn-ac-mlp", "fp8-tensorwise-ac-mlp"),
                    gpus=(2,), steps=30, takes=LLAMA_TAKES | {"plain_steps", "extra"}),
    "throughput-8b": Job("llama", "tok/s per GPU of each variant on each GPU count",
                         variants=(L_BF16, L_FP8), gpus=(2, 4), steps=30, takes=LLAMA_TAKES),
    "eval-8b": Job("eval8b", "FP8 delayed, validation every 10 of 20 steps, per --fp8-eval: peak "
                   "memory at evaluation against training's", variants=(L_FP8,), gpus=(2,),
                   steps=20, takes=frozenset({"gpus", "layers", "fp8_eval"})),
    "resume-8b": Job("resume8b", "FP8 delayed to --resume-to twice (the spread), to --resume-at "
                     "with a sharded checkpoint, resumed from it", variants=(L_FP8,), gpus=(2,),
                     takes=frozenset({"gpus", "layers"})),
    "probe-8b": Job("probe8b", "rank 0's live allocations at its first out-of-memory error "
                    "(scripts/memprobe.py), per variant", variants=(L_FP8,), gpus=(2,), steps=2,
                    takes=frozenset({"gpus", "variants", "layers"})),
    # one GPU: bench's variants, doctor's prediction (same micro-batch, to compare)
    "bench-gpt2": bench_job("gpt2", 16, 1024),
    "bench-gpt2-medium": bench_job("gpt2-medium", 8, 1024),
    "bench-gpt-1.3b": bench_job("gpt-1.3b", 8, 1024),
    "bench-llama3-8b": bench_job("llama3-8b", 1, 8192, layers=4),
    "doctor-gpt2": bench_job("gpt2", 16, 1024, kind="doctor"),
    "doctor-gpt-1.3b": bench_job("gpt-1.3b", 8, 1024, kind="doctor"),
    # the corpora alone (e.g. once, before several harness calls share a machine)
    "prepare": Job("prepare", "the real-text corpus in blocks of 1024 tokens",
                   takes=frozenset()),
    "prepare-8k": Job("prepare", "the real-text corpus in blocks of 8192 tokens",
                      takes=frozenset()),
}


# --------------------------------------------------------------------------------- runs
@dataclass
class Run:
    """One command of a plan, its log ``OUT/NAME.log`` headed by ``about`` (what the summary
    reads)."""

    name: str
    argv: list[str]
    gpus: int = 0  # 0: a host command
    about: dict[str, Any] = field(default_factory=dict)
    timeout: float = HOST_TIMEOUT
    env: dict[str, str] = field(default_factory=dict)
    alone: bool = False  # uses what the run before it made: never beside another
    needs: tuple[str, ...] = ()  # paths that must exist, else not run
    done_if: str = ""  # a glob: if it matches, the run is not needed
    fresh: tuple[str, ...] = ()  # paths removed before the run
    clean: tuple[str, ...] = ()  # paths removed after it


@dataclass
class Plan:
    out: Path
    runs: list[Run] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)  # written under OUT first
    sets: tuple[str, ...] = ()


PYTHON = [sys.executable]
PACKAGE = [*PYTHON, "-m", "fp8_lightning"]

# Throughput runs: no validation, no checkpoints, no text samples (the guard and monitor stay).
THROUGHPUT_YAML = """\
trainer:
  limit_val_batches: 0
  enable_checkpointing: false
  enable_progress_bar: false
  callbacks:
    - class_path: fp8_lightning.NaNGuard
    - class_path: fp8_lightning.TrainingMonitor
      init_args:
        sample_prompt: null
"""
# Loss runs: last.ckpt every 100 steps and the last 2 kept (step-0000100.ckpt is resumed).
LOSS_YAML = """\
trainer:
  enable_progress_bar: false
  callbacks:
    - class_path: fp8_lightning.Checkpoint
      init_args:
        every_n_train_steps: 100
        save_top_k: 0
        keep_last: 2
    - class_path: fp8_lightning.NaNGuard
    - class_path: fp8_lightning.TrainingMonitor
      init_args:
        sample_prompt: null
"""
# resume-8b's first run: throughput.yaml's callbacks plus a checkpoint at --resume-at
RESUME8B_YAML = """\
trainer:
  limit_val_batches: 0
  enable_progress_bar: false
  callbacks:
    - class_path: fp8_lightning.Checkpoint
      init_args:
        every_n_train_steps: {at}
        save_top_k: 0
    - class_path: fp8_lightning.NaNGuard
    - class_path: fp8_lightning.TrainingMonitor
      init_args:
        sample_prompt: null
"""


class Builder:
    """Turns jobs into a :class:`Plan` under the options of one call."""

    def __init__(self, opts: argparse.Namespace) -> None:
        # the runs start in the repository's root: their paths are absolute
        for key in ("out", "data", "data8k", "ckpt_root"):
            setattr(opts, key, os.path.abspath(getattr(opts, key)))
        self.opts = opts
        self.plan = Plan(Path(opts.out), sets=tuple(opts.sets or ()))
        self.prepared: set[str] = set()
        self.index = 0

    # ---- helpers
    def option(self, job: Job, key: str, default: Any) -> Any:
        """An option of the call where the job takes it, else the job's default."""
        value = getattr(self.opts, key, None)
        return default if value is None or key not in job.takes else value

    def add(self, run: Run) -> None:
        run.about = {"name": run.name, "index": self.index, **run.about}
        self.index += 1
        self.plan.runs.append(run)

    def out(self, *parts: str) -> str:
        return str(self.plan.out.joinpath(*parts))

    def data(self, seq_len: int) -> str:
        """The corpus in blocks of ``seq_len`` tokens, prepared by the first job that needs it."""
        path = self.opts.data if seq_len == 1024 else self.opts.data8k
        if path in self.prepared:
            return path
        self.prepared.add(path)
        purelib = sysconfig.get_paths()["purelib"]  # the image's Python sources: real text
        self.add(Run("corpus-text", [*PYTHON, "scripts/py_corpus.py", purelib, TEXT, "--max_mb",
                                     f"{self.opts.max_mb:g}", "--files", "16"],
                     done_if=f"{TEXT}/*.txt", alone=True))
        # 16 workers for 1024-token blocks; 4 for 8192 (each worker's share of the val split
        # must hold whole blocks: more workers can leave none on a small corpus). 8192-token
        # blocks take 2% for validation: 0.5% of a small corpus holds no block per rank.
        self.add(Run(f"prepare-{seq_len}", [*PACKAGE, "prepare", "--inputs", f"{TEXT}/*.txt",
                                            "--output_dir", path, "--seq_len", str(seq_len),
                                            "--val_fraction", "0.005" if seq_len == 1024 else "0.02",
                                            "--num_workers",
                                            "16" if seq_len == 1024 else "4"],
                     done_if=f"{path}/meta.json", alone=True))
        return path

    def gpu_timeout(self, default: float) -> float:
        return self.opts.timeout or default

    def fit(self, name: str, gpus: int, config: str, args: list[str], about: dict[str, Any],
            data: str, python: tuple[str, ...] = (), **kw: Any) -> None:
        """``python -m fp8_lightning fit --config CONFIG ARGS`` (``python``: a script run
        before the package, as memprobe.py)."""
        argv = [*PYTHON, *python, "-m", "fp8_lightning", "fit", "--config", config, *args]
        self.add(Run(name, argv, gpus, {"tool": "fit", "gpus": gpus, **about},
                     self.gpu_timeout(FIT_TIMEOUT),
                     needs=(f"{data}/meta.json", *kw.pop("needs", ())), **kw))

    def common(self, name: str, gpus: int, data: str) -> list[str]:
        """What every fit run sets: devices, data, its own root directory, no progress bar."""
        return ["--trainer.devices", str(gpus), "--data.data_dir", data, "--data.num_workers", "2",
                "--trainer.default_root_dir", self.out(name), "--trainer.enable_progress_bar",
                "false"]

    def extra(self, job: Job) -> list[str]:
        return shlex.split(self.opts.extra or "") if "extra" in job.takes else []

    def grid(self, job: Job) -> list[Row]:
        """The job's rows: fixed, or its variants x (one GPU, each strategy on each GPU count
        above one; the Llama jobs: their configs' FSDP2 on each count, one GPU included)."""
        gpus = self.option(job, "gpus", job.gpus)
        if job.rows:
            return [r for r in job.rows if r.gpus in gpus]
        variants = self.option(job, "variants", job.variants)
        if job.kind == "llama":
            return [Row(v, "fsdp", n) for v in variants for n in gpus]
        strategies = self.option(job, "strategies", job.strategies)
        rows = []
        for v in variants:
            rows += [Row(v)] if 1 in gpus else []
            rows += [Row(v, s, n) for n in gpus if n > 1 for s in strategies]
        return rows

    # ---- the kinds of job
    def build(self, name: str, job: Job) -> None:
        getattr(self, f"job_{job.kind}")(name, job)

    def job_prepare(self, name: str, job: Job) -> None:
        self.data(8192 if name.endswith("8k") else 1024)

    def job_gpt(self, name: str, job: Job) -> None:
        """GPT runs: fit (throughput settings, a StepProfile near the end), the plain script,
        the Fabric example."""
        steps = self.option(job, "steps", job.steps)
        profile_at = self.option(job, "profile_at", steps - 10)
        rows = self.grid(job)
        data = self.data(1024) if any(split_tool(r.variant)[0] != "plain" for r in rows) else ""
        for row in rows:
            tool, variant = split_tool(row.variant)
            fp8 = check_variant(row.variant).recipe is not None
            layout = "1gpu" if row.strategy == "single" else f"{row.strategy}-{row.gpus}gpu"
            about = {"section": job.model, "tool": tool, "variant": variant, "strategy":
                     row.strategy, "gpus": row.gpus, "fp8": fp8}
            if tool == "plain":
                self.plain(f"plain-{job.model}-{layout}", job.model, job.batch, row, steps, about)
            elif tool == "fabric":
                self.fabric(f"fabric-{job.model}-{layout}", job.model, row, steps, about)
            else:
                run = f"tp-{job.model}-{variant}-{layout}"
                config = "configs/gpt2_fp8.yaml" if fp8 else "configs/gpt2_bf16.yaml"
                strategy = [] if row.strategy == "single" else strategy_overrides(row.strategy,
                                                                                 "gpt")
                overlay = strategy[:2] if strategy[:1] == ["--config"] else []
                # StepProfile splits steps profile_at.. into GPU compute, exposed communication
                # and GPU idle; the summary's figures come from the steps before them
                args = [*overlay, *self.common(run, row.gpus, data), "--config",
                        self.throughput(), "--model.config.name", job.model, "--data.batch_size",
                        str(job.batch), "--trainer.max_steps", str(steps),
                        "--trainer.log_every_n_steps", "10",
                        "--trainer.callbacks+=fp8_lightning.StepProfile",
                        "--trainer.callbacks.start_step", str(profile_at),
                        *variant_overrides(variant, config), *strategy[len(overlay):],
                        *self.extra(job)]
                self.fit(run, row.gpus, config, args, about, data)

    def throughput(self) -> str:
        self.plan.files["throughput.yaml"] = THROUGHPUT_YAML
        return self.out("throughput.yaml")

    def plain(self, name: str, model: str, batch: int, row: Row, steps: int,
              about: dict[str, Any], more: tuple[str, ...] = ()) -> None:
        """benchmarks/plain_pytorch.py: one GPU as is, several under torchrun."""
        v = check_variant(f"plain:{split_tool(row.variant)[1]}")
        args = ["benchmarks/plain_pytorch.py", "--model", model, "--batch_size", str(batch)]
        if row.strategy != "single":
            if row.strategy not in PLAIN_STRATEGIES:
                raise UsageError(f"strategy {row.strategy!r} for the plain script; valid: "
                                 + ", ".join(PLAIN_STRATEGIES))
            args += ["--strategy", row.strategy]
        if v.activation_checkpointing != "none":
            args += ["--activation_checkpointing", v.activation_checkpointing]
        args += [*more, "--steps", str(steps)]
        launcher = ([*PYTHON] if row.strategy == "single" else
                    [*PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(row.gpus)])
        self.add(Run(name, [*launcher, *args], row.gpus, about, self.gpu_timeout(FIT_TIMEOUT)))

    def fabric(self, name: str, model: str, row: Row, steps: int, about: dict[str, Any]) -> None:
        """examples/fabric_train.py, GPT-2 124M at 16 x 1024 (its own in-memory corpus)."""
        v = check_variant(row.variant)
        args = ["--model", model, "--batch_size", "16", "--seq_len", "1024", "--corpus_chars",
                "1100000", "--steps", str(steps), "--log_every", "10", "--save_every", "100000",
                *(["--compile"] if v.compile else []), "--fresh"]
        args += [] if v.recipe == "delayed" else ["--recipe", v.recipe]
        args += [] if v.graphs else ["--no_cuda_graphs"]
        if row.strategy != "single":
            if row.strategy not in ("ddp", "fsdp"):
                raise UsageError(f"strategy {row.strategy!r} for the Fabric example; valid: ddp, "
                                 "fsdp")
            args += ["--devices", str(row.gpus), "--strategy", row.strategy]
        ckpt = self.out(f"{name}.ckpt")
        self.add(Run(name, [*PYTHON, "-m", "examples.fabric_train", *args, "--ckpt", ckpt],
                     row.gpus, about, self.gpu_timeout(FIT_TIMEOUT), clean=(ckpt,)))

    def loss_args(self, name: str, devices: int, ranks: int, data: str) -> list[str]:
        """A loss run's arguments (after its strategy's overlay): the micro-batch of one of
        ``ranks`` ranks, so that the global batch stays 32 x 1024."""
        self.plan.files["loss.yaml"] = LOSS_YAML
        return [*self.common(name, devices, data), "--config", self.out("loss.yaml"),
                "--trainer.max_steps", "200",
                "--trainer.val_check_interval", "200", "--trainer.limit_val_batches", "40",
                "--trainer.log_every_n_steps", "50", "--model.warmup_steps", "50",
                "--data.batch_size", str(32 // ranks)]

    def job_loss(self, name: str, job: Job) -> None:
        """One GPU reading exactly the n ranks' samples at every step, then DDP, then FSDP2."""
        n = max(self.option(job, "gpus", job.gpus))
        data = self.data(1024)
        config = "configs/gpt2_fp8.yaml"
        about = {"section": "loss", "variant": FP8}
        self.fit("loss-1gpu", 1, config, [*self.loss_args("loss-1gpu", 1, n, data),
                                          "--trainer.accumulate_grad_batches", str(n),
                                          "--data.emulate_ranks", str(n)],
                 {**about, "strategy": "single"}, data)
        run = f"loss-ddp-{n}gpu"
        self.fit(run, n, config, ["--config", "configs/ddp.yaml", *self.loss_args(run, n, n, data)],
                 {**about, "strategy": "ddp"}, data)
        self.job_resume(name, job)

    def job_resume(self, name: str, job: Job) -> None:
        """FSDP2 with sharded checkpoints at 100 and 200; 100 resumed to 200; consolidated."""
        n = max(self.option(job, "gpus", job.gpus))
        data = self.data(1024)
        config = "configs/gpt2_fp8.yaml"
        about = {"section": "loss", "variant": FP8, "strategy": "fsdp"}
        run = f"loss-fsdp-{n}gpu"
        ckpts = self.out(run, "checkpoints")
        # this one samples text at its validation: under FSDP every rank runs the sampler
        self.fit(run, n, config, ["--config", "configs/fsdp.yaml", *self.loss_args(run, n, n, data),
                                  "--trainer.callbacks.init_args.sample_prompt", "import torch"],
                 about, data)
        self.add(Run("fsdp-ckpt-ls", ["ls", "-la", ckpts, f"{ckpts}/last.ckpt"], alone=True))
        self.add(Run("fsdp-checkpoints", [*PACKAGE, "checkpoints", self.out(run)], alone=True))
        resumed = f"{run}-resumed"
        self.fit(resumed, n, config, ["--config", "configs/fsdp.yaml",
                                      *self.loss_args(resumed, n, n, data),
                                      "--ckpt_path", f"{ckpts}/step-0000100.ckpt"],
                 {**about, "role": "resumed"}, data, alone=True,
                 needs=(f"{ckpts}/step-0000100.ckpt",))
        consolidated = self.out("consolidated.ckpt")
        self.add(Run("consolidate", [*PACKAGE, "consolidate", f"{ckpts}/last.ckpt", consolidated],
                     alone=True, needs=(f"{ckpts}/last.ckpt",)))
        self.add(Run("generate", [*PACKAGE, "generate", "--ckpt", consolidated, "--prompt",
                                  "import torch", "--max_new_tokens", "24", "--backend", "torch"],
                     1, {"section": "generate"}, self.gpu_timeout(FIT_TIMEOUT), alone=True,
                     needs=(consolidated,), clean=(consolidated,)))

    # ---- Llama
    def llama(self) -> tuple[str, str]:
        """(preset, config stem) of --llama."""
        return {"8b": ("llama3-8b", "configs/llama3_8b"),
                "3b": ("llama3.2-3b", "configs/llama3_3b")}[self.opts.llama]

    def llama_fit(self, name: str, job: Job, variant: str, gpus: int, args: list[str],
                  about: dict[str, Any], overlay: str = "", **kw: Any) -> None:
        """A Llama run: its config's FSDP2, ``overlay`` (default throughput.yaml), ARGS."""
        preset, stem = self.llama()
        v = check_variant(variant)
        if split_tool(variant)[0] != "fit":
            raise UsageError(f"{variant}: {name} runs fit only")
        config = f"{stem}_{'fp8' if v.recipe else 'bf16'}.yaml"
        data = self.data(8192)
        layers = self.option(job, "layers", None)
        self.fit(name, gpus, config, [*self.common(name, gpus, data), "--config",
                                      overlay or self.throughput(),
                                      *variant_overrides(variant, config),
                                      *(["--model.config.n_layer", str(layers)] if layers else []),
                                      *args],
                 {"section": about.pop("section"), "model": preset, "variant": variant,
                  "strategy": "fsdp", "fp8": v.recipe is not None, **about}, data, **kw)

    def job_llama(self, name: str, job: Job) -> None:
        """table-8b (val loss at the last step) and throughput-8b."""
        steps = self.option(job, "steps", job.steps)
        section = "8b" if name == "table-8b" else "tp8b"
        for row in self.grid(job):
            tool, variant = split_tool(row.variant)
            run = f"{'t8' if section == '8b' else 'tp8'}-{row.variant.replace(':', '-')}-{row.gpus}gpu"
            if tool == "plain":  # the same model in plain_pytorch.py's loop: speed only
                plain_steps = self.opts.plain_steps or 60
                layers = self.option(job, "layers", None)
                self.plain(run, self.llama()[0], 1, Row(row.variant, "fsdp", row.gpus), plain_steps,
                           {"section": section, "tool": "plain", "variant": variant,
                            "strategy": "fsdp", "gpus": row.gpus, "fp8": False},
                           ("--warmup", "20", *(["--n_layer", str(layers)] if layers else [])))
                continue
            args = ["--trainer.max_steps", str(steps), "--trainer.log_every_n_steps", "5"]
            if section == "8b":
                args += ["--trainer.val_check_interval", str(steps), "--trainer.limit_val_batches",
                         "4", "--trainer.num_sanity_val_steps", "0"]
            self.llama_fit(run, job, row.variant, row.gpus, [*args, *self.extra(job)],
                           {"section": section})

    def job_eval8b(self, name: str, job: Job) -> None:
        """Validation inside an FP8 run: BF16 (fp8_eval false) and FP8 (true)."""
        n = max(self.option(job, "gpus", job.gpus))
        for value in self.opts.fp8_eval or ("false", "true"):
            self.llama_fit(f"e8-fp8eval-{value}", job, job.variants[0], n,
                           ["--trainer.max_steps", "20", "--trainer.log_every_n_steps", "5",
                            "--trainer.val_check_interval", "10", "--trainer.limit_val_batches",
                            "4", "--trainer.num_sanity_val_steps", "0",
                            *plugin_overrides({"fp8_eval": value})],
                           {"section": "eval8b", "fp8_eval": value})

    def job_resume8b(self, name: str, job: Job) -> None:
        """Twice uninterrupted to --resume-to (no two runs are bitwise equal: the spread), once to
        --resume-at with a sharded checkpoint on disk, resumed from it; one LR schedule for all."""
        n = max(self.option(job, "gpus", job.gpus))
        at, to = self.opts.resume_at, self.opts.resume_to
        root = self.opts.ckpt_root  # on disk: the checkpoint in RAM beside the ranks' own host
        # memory can exhaust the host
        first = f"{root}/r8-first"
        self.plan.files["resume8b.yaml"] = RESUME8B_YAML.format(at=at)
        args = ["--trainer.log_every_n_steps", "1", "--model.lr_decay_steps", str(to)]
        for role in ("whole", "again"):
            self.llama_fit(f"r8-{role}", job, job.variants[0], n,
                           [*args, "--trainer.max_steps", str(to)],
                           {"section": "resume8b", "role": role})
        self.add(Run("r8-disk", ["df", "-h", root], alone=True, fresh=(first,)))
        self.llama_fit("r8-first", job, job.variants[0], n,
                       [*args, "--trainer.max_steps", str(at), "--trainer.default_root_dir",
                        first], {"section": "resume8b", "role": "first"},
                       overlay=self.out("resume8b.yaml"), alone=True)
        self.add(Run("r8-ckpt-size", ["du", "-sh", f"{first}/checkpoints/last.ckpt"], alone=True))
        self.add(Run("r8-checkpoints", [*PACKAGE, "checkpoints", first], alone=True))
        self.llama_fit("r8-resumed", job, job.variants[0], n,
                       [*args, "--trainer.max_steps", str(to), "--ckpt_path",
                        f"{first}/checkpoints/last.ckpt"],
                       {"section": "resume8b", "role": "resumed"}, alone=True,
                       needs=(f"{first}/checkpoints/last.ckpt",), clean=(first,))

    def job_probe8b(self, name: str, job: Job) -> None:
        """Each variant (e.g. its -ac-*) under scripts/memprobe.py, two steps."""
        n = max(self.option(job, "gpus", job.gpus))
        for variant in self.option(job, "variants", job.variants):
            run = f"p8-{variant}"
            probe = self.out(f"{run}.txt")
            self.llama_fit(run, job, variant, n, ["--trainer.max_steps", "2",
                                                  "--trainer.log_every_n_steps", "1"],
                           {"section": "probe8b", "probe": f"{run}.txt"},
                           python=("scripts/memprobe.py",), env={"MEMPROBE_OUT": probe},
                           fresh=(probe,))

    # ---- one GPU: bench and doctor
    def job_bench(self, name: str, job: Job) -> None:
        self.one_gpu(name, job, ["bench", "--variants",
                                 ",".join(self.option(job, "variants", job.variants)),
                                 "--steps", str(self.option(job, "steps", job.steps)),
                                 "--warmup", str(self.opts.warmup or 5),
                                 "--output_dir", self.out(name)])

    def job_doctor(self, name: str, job: Job) -> None:
        self.one_gpu(name, job, ["doctor", "--output", self.out(f"{name}.json")])

    def one_gpu(self, name: str, job: Job, command: list[str]) -> None:
        if job.kind == "bench":
            for v in self.option(job, "variants", job.variants):
                if split_tool(v)[0] != "fit":
                    raise UsageError(f"{v}: bench times fit's step (no tool prefix)")
                check_variant(v)
        layers = self.option(job, "layers", None) or job.layers
        argv = [*PACKAGE, command[0], "--config", "configs/gpt2_fp8.yaml", *command[1:],
                "--model", job.model, *(["--n_layer", str(layers)] if layers else []),
                "--batch_size", str(job.batch), "--seq_len", str(job.seq_len), *self.extra(job)]
        self.add(Run(name, argv, 1, {"section": job.kind, "tool": job.kind},
                     self.gpu_timeout(BENCH_TIMEOUT)))


def build_plan(opts: argparse.Namespace) -> Plan:
    """The plan of a call: every job's runs, in order, each corpus prepared once before the
    first run that reads it."""
    for job in opts.jobs:
        if job not in JOBS:
            raise UsageError(f"unknown job {job!r}; valid: {', '.join(JOBS)}")
    if not 1 <= opts.resume_at < opts.resume_to:
        raise UsageError(f"--resume-at {opts.resume_at} --resume-to {opts.resume_to}; valid: "
                         "1 <= resume-at < resume-to")
    for s in opts.sets or ():
        if not all(g.isdigit() for g in s.split(",")):
            raise UsageError(f"--sets {s!r}: GPU indices joined by commas (0 or 0,1)")
    builder = Builder(opts)
    for name in opts.jobs:
        builder.build(name, JOBS[name])
    if not opts.sets:  # the jobs' own default sets, where every job of the call has the same
        defaults = {JOBS[name].sets for name in opts.jobs}
        builder.plan.sets = defaults.pop() if len(defaults) == 1 else ()
    return builder.plan


