"""``StepProfile``: where a training step's time goes on each GPU, under the run's own strategy.

A few steps of ``fit`` are profiled with ``torch.profiler`` (CUDA activity: the kernels and the
runtime calls, no per-op CPU recording) and each rank's step time is split into

* **GPU compute**: time some non-communication kernel runs (the union of their intervals);
* **exposed communication**: time NCCL kernels run with no compute kernel beside them (the part
  of DDP's all-reduce or FSDP2's all-gather / reduce-scatter that the step waits for);
* **GPU idle**: time no kernel runs at all: the GPU waits on the host (Python issuing kernels,
  Lightning's hooks, data loading, a host sync);

which add up to the step's wall time. ``comm`` (all NCCL time, hidden or not) and ``host waits``
(time the host blocked in CUDA synchronisation calls) are printed beside them. Rank zero prints
one line per rank and logs its own split as ``profile/*`` scalars.

Kineto keeps CUPTI attached after a profile unless ``TEARDOWN_CUPTI=1``, and a run whose host
sets the pace stays markedly slower after the profiled steps (pytorch/pytorch#144455; measured:
docs/benchmarks.md, Method): ``StepProfile`` sets it (CUDA >= 12.6, unless already set).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from ..config import ConfigError
from ..logs import log_metrics

FIELDS = ("step_ms", "compute_ms", "exposed_comm_ms", "gpu_idle_ms", "comm_ms", "host_wait_ms")
# CUDA runtime calls in which the host waits for the GPU
SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy"}


def teardown_cupti_after_profiling() -> None:
    """Ask Kineto to detach CUPTI when the profiler stops. Left attached (its default), CUPTI
    keeps taxing every kernel launch for the rest of the run, so a host-bound step stays slower
    after a profile (pytorch/pytorch#144455; docs/benchmarks.md, Method). torch itself forces
    it off only for CUDA graphs before CUDA 12.6, whose CUPTI crashed re-attaching after a
    teardown; a value the user set is kept."""
    import os

    from torch.torch_version import TorchVersion

    if TorchVersion(torch.version.cuda or "0.0") >= "12.6":
        os.environ.setdefault("TEARDOWN_CUPTI", "1")


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals (overlaps counted once)."""
    total, start, end = 0.0, None, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    return total + (end - start if end is not None else 0.0)


def is_communication(kernel_name: str) -> bool:
    return "nccl" in kernel_name.lower()


def split_step(kernels: list[tuple[str, float, float]], wall_ms: float, steps: int,
               host_wait_ms: Optional[float] = None) -> dict[str, Optional[float]]:
    """Per step, in ms: the wall time split into compute, exposed communication and GPU idle.

    ``kernels`` are ``(name, start_us, end_us)`` on one GPU over ``steps`` steps of ``wall_ms``.
    """
    comm = [(s, e) for name, s, e in kernels if is_communication(name)]
    compute = [(s, e) for name, s, e in kernels if not is_communication(name)]
    busy_ms = union_length(comm + compute) / 1e3
    compute_ms = union_length(compute) / 1e3
    return {"step_ms": wall_ms / steps, "compute_ms": compute_ms / steps,
            "exposed_comm_ms": (busy_ms - compute_ms) / steps,
            "gpu_idle_ms": max(0.0, wall_ms - busy_ms) / steps,
            "comm_ms": union_length(comm) / 1e3 / steps,
            "host_wait_ms": None if host_wait_ms is None else host_wait_ms / steps}


def kernel_summary(kernels: list[tuple[str, float, float]], steps: int, top: int = 30
                   ) -> dict[str, Any]:
    """Per step, in ms: GPU kernel time by category and the ``top`` kernels by time
    (``[name, category, ms, calls]``; :func:`~fp8_lightning.measure.kernel_table`): where the
    compute goes."""
    from ..measure import kernel_table

    totals: dict[str, list[float]] = {}  # name -> [us, calls] over the steps
    for name, start, end in kernels:
        entry = totals.setdefault(name, [0.0, 0])
        entry[0] += end - start
        entry[1] += 1
    categories, ranked = kernel_table(
        {name: (us / 1e3 / steps, calls / steps) for name, (us, calls) in totals.items()}, top)
    return {"categories": categories, "top": ranked}


def format_split(rows: list[dict[str, Optional[float]]], first: int, steps: int) -> str:
    """The printed table: one line per rank."""
    def cell(value: Optional[float]) -> str:
        return f"{'n/a':>14}" if value is None else f"{value:>14.2f}"

    lines = [f"profile: steps {first}-{first + steps - 1}, ms per step (step = GPU compute + "
             "exposed comm + GPU idle)",
             f"{'rank':<6}" + "".join(f"{name[:-3].replace('_', ' '):>14}" for name in FIELDS)]
    for rank, row in enumerate(rows):
        lines.append(f"{rank:<6}" + "".join(cell(row[name]) for name in FIELDS))
    return "\n".join(lines)


class StepProfile(Callback):
    """Profile ``steps`` training steps from ``start_step`` (after compilation and CUDA-graph
    capture) and print, per rank, how the step's time splits into GPU compute, exposed
    communication and GPU idle (host-bound) time.

    Args:
        start_step: the first profiled optimizer step.
        steps: how many steps to profile.
        trace_dir: also write each rank's Chrome trace there (``rank<N>.json``; open it in
            Perfetto or ``chrome://tracing``).
        top: how many of the most expensive kernels ``kernels`` lists.

    After the window, ``result`` holds every rank's split and ``kernels`` this rank's GPU time
    by kernel category and its top kernels (:func:`kernel_summary`; None without a GPU).
    """

    def __init__(self, start_step: int = 20, steps: int = 5,
                 trace_dir: Optional[str] = None, top: int = 30) -> None:
        if start_step < 0 or steps < 1 or top < 1:
            raise ConfigError([f"StepProfile(start_step={start_step}, steps={steps}, top={top}): "
                               "start_step >= 0, steps >= 1 and top >= 1"], "trainer.callbacks")
        self.start_step, self.steps, self.trace_dir, self.top = start_step, steps, trace_dir, top
        self.result: Optional[list[dict[str, Optional[float]]]] = None  # per rank, once done
        self.kernels: Optional[dict[str, Any]] = None  # this rank's, once done on a GPU
        self._profiler: Any = None
        self._t0 = 0.0

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step = trainer.global_step
        if self._profiler is None and self.result is None and step == self.start_step:
            self._start(pl_module.device)
        elif self._profiler is not None and step >= self.start_step + self.steps:
            self._finish(trainer, pl_module, step - self.start_step)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._profiler is not None:  # the run ended inside the window
            self._finish(trainer, pl_module, trainer.global_step - self.start_step)

    def _start(self, device: torch.device) -> None:
        self._profiler = False  # on a CPU: the step time alone
        if device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize(device)
            teardown_cupti_after_profiling()
            self._profiler = profile(activities=[ProfilerActivity.CUDA])
            self._profiler.start()
        self._t0 = time.perf_counter()

    def _finish(self, trainer: L.Trainer, pl_module: L.LightningModule, steps: int) -> None:
        device = pl_module.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - self._t0) * 1e3
        profiler, self._profiler = self._profiler, None
        steps = max(1, steps)
        if profiler:
            profiler.stop()
            kernels, waits = [], 0.0
            for event in profiler.events():
                if event.device_type.name == "CUDA":
                    kernels.append((event.name, event.time_range.start, event.time_range.end))
                elif event.name in SYNC_CALLS:
                    waits += (event.time_range.end - event.time_range.start) / 1e3
            split = split_step(kernels, wall_ms, steps, waits)
            self.kernels = kernel_summary(kernels, steps, self.top)
            if self.trace_dir:
                traces = Path(self.trace_dir)
                traces.mkdir(parents=True, exist_ok=True)
                profiler.export_chrome_trace(str(traces / f"rank{trainer.global_rank}.json"))
        else:
            split = {name: None for name in FIELDS} | {"step_ms": wall_ms / steps}
        values = torch.tensor([float("nan") if split[n] is None else split[n] for n in FIELDS],
                              dtype=torch.float64, device=device)
        gathered = trainer.strategy.all_gather(values)  # (world, fields) on several ranks
        gathered = gathered.reshape(-1, len(FIELDS)).cpu().tolist()
        self.result = [{n: (None if v != v else v) for n, v in zip(FIELDS, row)}
                       for row in gathered]
        rank_zero_info(format_split(self.result, self.start_step, steps))
        own = self.result[0]
        log_metrics(trainer, {f"profile/{n}": v for n, v in own.items() if v is not None})
        log_dir = trainer.log_dir if trainer.loggers else None  # no logger: no file in the cwd
        if trainer.is_global_zero and log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            record = {"first_step": self.start_step, "steps": steps, "ranks": self.result,
                      "kernels": self.kernels}  # rank zero's GPU time by kernel
            (Path(log_dir) / "step_profile.json").write_text(json.dumps(record, indent=1) + "\n")
