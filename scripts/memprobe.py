"""Where the GPU memory goes: a module's run (``-m MODULE ARGS...``) with CUDA memory history
recorded; at the first out-of-memory error the live allocations, grouped by where they were
made, go to ``MEMPROBE_OUT`` (default ``memprobe.txt``).

    python scripts/memprobe.py -m fp8_lightning fit --config configs/llama3_8b_fp8.yaml ...

``MEMPROBE_FRACTION`` (0-1) caps this process's share of the GPU
(``torch.cuda.set_per_process_memory_fraction``), so a run that fits stops where its live set
crosses that share. Rank 0 only: Lightning starts the other ranks as plain ``python -m MODULE``.
The memory snapshot is PyTorch's (``torch.cuda.memory._snapshot``, the documented out-of-memory
observer); only its summary is written, the pickle is large.
"""

from __future__ import annotations

import collections
import os
import runpy
import sys

import torch

# The frames that say what an allocation is for, innermost first: the package, TE, FSDP2,
# the optimizer, checkpointing, compiled graphs (inductor's generated files).
WHERE = ("fp8_lightning/", "transformer_engine/", "distributed/fsdp/", "torch/optim/",
         "utils/checkpoint", "torchinductor", "torchao/")
GIB = 1024 ** 3


def frame_name(frame: dict) -> str:
    path = frame["filename"]
    for mark in WHERE:
        if mark in path:
            path = mark.rstrip("/") + ":" + path.split(mark, 1)[1]
            break
    else:
        path = os.path.basename(path)
    return f"{path}:{frame['line']} {frame['name']}"


def where(frames: list[dict]) -> str:
    """The innermost telling frame and the innermost package frame ('-' where none)."""
    inner = next((f for f in frames if any(m in f["filename"] for m in WHERE)), None)
    ours = next((f for f in frames if "fp8_lightning/" in f["filename"]), None)
    return (f"{frame_name(inner) if inner else '-'}  <-  "
            f"{frame_name(ours) if ours and ours is not inner else '-'}")


def summary(snapshot: dict, why: str) -> str:
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    sizes = collections.Counter()
    total = 0
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            key = where(block.get("frames", []))
            groups[key][0] += block["size"]
            groups[key][1] += 1
            sizes[block["size"]] += 1
            total += block["size"]
    lines = [f"{why}: {total / GIB:.2f} GiB live in {sum(g[1] for g in groups.values())} blocks",
             "GiB      count  where (innermost telling frame <- innermost fp8_lightning frame)"]
    for key, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:40]:
        lines.append(f"{size / GIB:7.3f}  {count:5d}  {key}")
    lines.append("block sizes holding the most (MiB x count): " + ", ".join(
        f"{s / 2**20:.0f} x {n}" for s, n in sorted(sizes.items(), key=lambda kv: -kv[0] * kv[1])[:12]))
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] != "-m":
        print("error: usage: memprobe.py -m MODULE [ARGS...]", file=sys.stderr)
        sys.exit(2)
    out = os.environ.get("MEMPROBE_OUT", "memprobe.txt")
    if torch.cuda.is_available():
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
        fraction = os.environ.get("MEMPROBE_FRACTION")
        if fraction:
            torch.cuda.set_per_process_memory_fraction(float(fraction))
        written = []

        def on_oom(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
            if written:  # the first error is the one that says it
                return
            written.append(out)
            with open(out, "w") as f:
                f.write(summary(torch.cuda.memory._snapshot(),
                                f"out of memory on GPU {device} asking for {alloc / GIB:.2f} GiB"))

        torch._C._cuda_attach_out_of_memory_observer(on_oom)
    module = sys.argv[2]
    sys.argv = [module] + sys.argv[3:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
