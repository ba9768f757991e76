"""The maintainers' harness scripts: how ``scripts/multi_gpu_summary.py`` reads a run's log (its
figures are the docs' several-GPU tables)."""

from tests._runs import ROOT, load_script


def summary_module():
    return load_script("scripts/multi_gpu_summary.py")


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


def test_gpu_tests_spread_the_suite_over_the_gpus_and_run_every_file_once(tmp_path):
    """scripts/gpu_tests.sh with a stand-in for python that records each pytest it is given: one
    pytest per file; on four GPUs the two-GPU file runs on 0,1 first while 2 and 3 take one-GPU
    files, and 0 and 1 take files after it; on two GPUs 0 and 1 take the one-GPU files, then the
    two-GPU file runs; every GPU test file runs exactly once."""
    import os
    import subprocess

    fake = tmp_path / "python"
    # a pytest takes a moment, so that every worker gets files
    fake.write_text('#!/bin/bash\ncase "$*" in *device_count*) echo "$NG"; exit 0;; esac\n'
                    'echo "$CUDA_VISIBLE_DEVICES|$*" >> "$CALLS"; sleep 0.2\n')
    fake.chmod(0o755)
    files = sorted(p.relative_to(ROOT).as_posix()
                   for p in [*ROOT.glob("tests/test_gpu*.py"), ROOT / "tests/test_notebook.py"])
    for n, one_gpu_sets in ((4, {"0", "1", "2", "3"}), (2, {"0", "1"})):
        calls = tmp_path / f"calls{n}.txt"
        env = dict(os.environ, NG=str(n), CALLS=str(calls), PYTHON=str(fake),
                   OUT=str(tmp_path / f"out{n}"))
        subprocess.run(["bash", str(ROOT / "scripts" / "gpu_tests.sh"), "-k", "not slow"],
                       env=env, check=True, capture_output=True, timeout=60)
        runs = [(gpus, [a for a in args.split() if a.startswith("tests/")])
                for gpus, args in (line.split("|") for line in calls.read_text().splitlines())]
        assert all(len(ran) == 1 for _, ran in runs)  # a pytest per file
        order = [gpus for gpus, _ in runs]
        assert [ran for gpus, ran in runs if gpus == "0,1"] == [["tests/test_gpu_ddp.py"]]
        # four GPUs: the two-GPU file first; two: last
        assert order.index("0,1") == (0 if n == 4 else len(order) - 1) or n == 4 and \
            set(order[:order.index("0,1")]) <= {"2", "3"}
        assert {gpus for gpus in order if gpus != "0,1"} == one_gpu_sets
        assert sorted(f for _, ran in runs for f in ran) == files
        assert all("-m gpu" in line and line.endswith("-k not slow")
                   for line in calls.read_text().splitlines())


def test_the_8b_seed_table_runs_its_variants_on_gpu_sets_at_once(tmp_path):
    """multi_gpu.sh table-8b with SETS8B="0,1 2,3" (a stand-in for python records each fit):
    each variant's FSDP2 run gets one GPU pair, two at a time, every variant once."""
    import os
    import subprocess

    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\ncase "$*" in *device_count*) echo 4; exit 0;; esac\n'
                    'echo "$CUDA_VISIBLE_DEVICES|$*" >> "$CALLS"\n')
    fake.chmod(0o755)
    data = tmp_path / "d8"
    data.mkdir()
    (data / "meta.json").write_text("{}")  # the corpus "prepared": no preparing here
    calls = tmp_path / "calls.txt"
    env = dict(os.environ, CALLS=str(calls), PYTHON=str(fake), OUT=str(tmp_path / "out"),
               DATA8K=str(data), SETS8B="0,1 2,3", VARIANTS8B="bf16 fp8-delayed fp8-current")
    subprocess.run(["bash", str(ROOT / "scripts" / "multi_gpu.sh"), "table-8b"], env=env,
                   capture_output=True, timeout=60)
    fits = [line.split("|") for line in calls.read_text().splitlines() if " fit " in line]
    ran = sorted((gpus, "llama3_8b_bf16" in args, "recipe current" in args) for gpus, args in fits)
    # (the first two start together: their lines come in either order)
    assert ran == [("0,1", False, True), ("0,1", True, False), ("2,3", False, False)]
    assert all("--trainer.devices 2" in args for _, args in fits)
