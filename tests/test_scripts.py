"""The maintainers' harness scripts: how ``scripts/multi_gpu_summary.py`` reads a run's log (its
figures are the docs' several-GPU tables)."""

import importlib.util

from tests._runs import ROOT


def summary_module():
    spec = importlib.util.spec_from_file_location("multi_gpu_summary",
                                                  ROOT / "scripts" / "multi_gpu_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def monitor_line(step: int, ms: float, mfu: str) -> str:
    tok_s = round(16 * 1024 * 2 / ms * 1000)
    return (f"step {step} | loss 4.0000 | lr 1.00e-04 | norm 1.000 | dt {ms}ms | tok/s {tok_s:,} "
            f"| mfu {mfu} | mfu_fp8 1.0% | FP8 delayed")


def test_the_median_keeps_the_lines_before_the_profile_and_after_the_first_two(tmp_path):
    """Steps 60-64 profiled (StepProfile(start_step=60)): the monitor's line at 70 holds them and
    every later step runs slower where the host sets the pace (CUPTI stays attached after the
    profiler: pytorch/pytorch#144455), so only the lines before are kept, without the first two
    (compilation, warm-up). The MFU is the median of the kept lines' by value."""
    summary = summary_module()
    times = {10: 400.0, 20: 90.0, 30: 60.0, 40: 64.0, 50: 62.0, 60: 61.0, 70: 180.0, 80: 100.0,
             90: 99.0}
    mfus = {10: "2.0%", 20: "9.0%", 30: "21.0%", 40: "19.5%", 50: "20.5%", 60: "20.8%",
            70: "7.0%", 80: "12.0%", 90: "12.1%"}
    log = tmp_path / "tp-gpt2-fp8-fsdp-2gpu.log"
    lines = ["=== devices: 2"] + [monitor_line(s, ms, mfus[s]) for s, ms in times.items()]
    lines.insert(7, "profile: steps 60-64, ms per step (step = GPU compute + exposed comm + GPU idle)")
    log.write_text("\n".join(lines) + "\n")
    run = summary.read(log)
    assert run["ms"] == 61.5  # the median of 60, 64, 62 and 61
    assert run["mfu"] == "20.5%" and run["gpus"] == 2
    # Without a profile only the first two lines go
    log.write_text("\n".join(line for line in lines if not line.startswith("profile")) + "\n")
    assert summary.read(log)["ms"] == 64.0  # 60, 64, 62, 61, 180, 100, 99


def test_the_fabric_example_s_lines_count_as_a_run_of_its_gpus(tmp_path, capsys):
    """``examples/fabric_train.py`` prints tok/s per GPU and no MFU: its runs are rows of the table
    beside the ``fit`` runs, scaled against its own one-GPU run."""
    summary = summary_module()

    def fabric_log(name: str, gpus: int, ms: int) -> None:
        per_gpu = round(16 * 1023 / ms * 1000)
        lines = [f"=== devices: {gpus}", "precision: FP8 delayed"] + [
            f"step {s:>5} | loss 5.0000 | lr 6.00e-04 | {ms} ms/step | tok/s per GPU {per_gpu:,} "
            "| fp8-delayed" for s in range(10, 101, 10)]
        (tmp_path / name).write_text("\n".join(lines) + "\n")

    fabric_log("fabric-gpt2-1gpu.log", 1, 50)
    fabric_log("fabric-gpt2-ddp-2gpu.log", 2, 55)
    run = summary.read(tmp_path / "fabric-gpt2-ddp-2gpu.log")
    assert run["gpus"] == 2 and run["ms"] == 55 and run["mfu"] == "n/a"
    assert run["tok_s"] == 2 * round(16 * 1023 / 55 * 1000)
    summary.main(tmp_path)
    out = capsys.readouterr().out
    assert "fabric-fp8       ddp-2gpu      297,600 per GPU  scaling  0.91" in out, out
