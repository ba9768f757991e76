"""The maintainers' harness scripts: how ``scripts/multi_gpu_summary.py`` reads a run's log (its
figures are the docs' several-GPU tables), and how ``scripts/gpu_tests.sh`` and
``scripts/multi_gpu.sh`` spread their runs over a machine's GPUs (python stood in for)."""

import json
import os
import re
import subprocess
import sys
import tarfile

import pytest

from tests._runs import ROOT, load_script


def summary_module():
    return load_script("scripts/multi_gpu_summary.py")


def monitor_line(step: int, ms: float, mfu: str) -> str:
    tok_s = round(16 * 1024 * 2 / ms * 1000)
    return (f"step {step} | loss 4.0000 | lr 1.00e-04 | norm 1.000 | dt {ms}ms | tok/s {tok_s:,} "
            f"| mfu {mfu} | mfu_fp8 1.0% | FP8 delayed")


def stand_in_python(tmp_path, record, gpus="4", pause=""):
    """A stand-in for python that the GPU scripts call: it answers ``device_count`` with
    ``gpus`` and appends ``record`` (shell words, e.g. ``$CUDA_VISIBLE_DEVICES|$*``) to
    ``$CALLS`` for every other call, then sleeps ``pause`` seconds where given."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/bash\ncase "$*" in *device_count*) echo "{gpus}"; exit 0;; esac\n'
                    f'echo "{record}" >> "$CALLS"' + (f"; sleep {pause}" if pause else "") + "\n")
    fake.chmod(0o755)
    return fake


def multi_gpu_calls(tmp_path, job, record, **env):
    """``scripts/multi_gpu.sh JOB`` with python stood in for (:func:`stand_in_python` recording
    ``record``) and its corpora taken as prepared: each recorded call's fields."""
    calls = tmp_path / "calls.txt"
    subprocess.run(["bash", str(ROOT / "scripts" / "multi_gpu.sh"), job], capture_output=True,
                   timeout=60, env=dict(os.environ, CALLS=str(calls), OUT=str(tmp_path / "out"),
                                        PYTHON=str(stand_in_python(tmp_path, record)),
                                        DATA=str(prepared_corpus(tmp_path, "d")),
                                        DATA8K=str(prepared_corpus(tmp_path, "d8")), **env))
    return [line.split("|") for line in calls.read_text().splitlines()]


def prepared_corpus(tmp_path, name):
    """A data directory the scripts take as prepared (its meta.json): no preparing here."""
    data = tmp_path / name
    data.mkdir()
    (data / "meta.json").write_text("{}")
    return data


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


def test_gpu_tests_spread_the_suite_over_the_gpus_and_run_every_test_once(tmp_path):
    """scripts/gpu_tests.sh with a stand-in for python that records each pytest it is given: each
    pair of GPUs takes the two-GPU tests (a pytest per test function), then its GPUs take one-GPU
    files (a pytest per file), as does a GPU without a pair; every GPU test file runs, the
    two-GPU file once per test function; past DEADLINE nothing starts and what is left is
    listed."""
    # a pytest takes a moment, so that every GPU gets work
    fake = stand_in_python(tmp_path, "$CUDA_VISIBLE_DEVICES|$*", gpus="$NG", pause="0.3")
    two = "tests/test_gpu_ddp.py"
    functions = re.findall(r"^def (test_\w+)", (ROOT / two).read_text(), re.M)
    files = sorted(p.relative_to(ROOT).as_posix()
                   for p in [*ROOT.glob("tests/test_gpu*.py"), ROOT / "tests/test_notebook.py"]
                   if p.name != "test_gpu_ddp.py")

    def suite(n, **env):
        calls = tmp_path / f"calls{n}{env}.txt"
        result = subprocess.run(
            ["bash", str(ROOT / "scripts" / "gpu_tests.sh"), "-k", "not slow"],
            env=dict(os.environ, NG=str(n), CALLS=str(calls), PYTHON=str(fake),
                     OUT=str(tmp_path / f"out{n}"), **env), capture_output=True, text=True,
            timeout=60)
        lines = calls.read_text().splitlines() if calls.exists() else []
        assert all("-m gpu" in line and line.endswith("-k not slow") for line in lines)
        runs = [(gpus, [a for a in args.split() if a.startswith("tests/")])
                for gpus, args in (line.split("|") for line in lines)]
        assert all(len(ran) == 1 for _, ran in runs)  # a pytest per test or file
        return result, [(gpus, ran[0]) for gpus, ran in runs]

    for n, pairs, singles in ((4, {"0,1", "2,3"}, {"0", "1", "2", "3"}), (3, {"0,1"}, {"0", "1", "2"})):
        result, runs = suite(n)
        assert result.returncode == 0, result.stdout
        assert sorted(ran for gpus, ran in runs if "," in gpus) == sorted(
            f"{two}::{f}" for f in functions)
        assert {gpus for gpus, _ in runs if "," in gpus} == pairs
        assert {gpus for gpus, _ in runs if "," not in gpus} == singles
        assert sorted(ran for gpus, ran in runs if "," not in gpus) == files
    # FILES " " (none): the two-GPU tests alone; TWO_TESTS " ": the one-GPU files alone
    result, runs = suite(2, FILES=" ")
    assert result.returncode == 0 and sorted(ran for _, ran in runs) == sorted(
        f"{two}::{f}" for f in functions)
    result, runs = suite(2, TWO_TESTS=" ")
    assert result.returncode == 0 and sorted(ran for _, ran in runs) == files
    result, runs = suite(2, DEADLINE="0")
    assert runs == [] and result.returncode != 0
    assert result.stdout.split("not run (DEADLINE):")[1].split() == \
        [f"{two}::{f}" for f in functions] + sorted(files, key=lambda f: -(ROOT / f).stat().st_size)


def test_the_8b_seed_table_runs_its_variants_on_gpu_sets_at_once(tmp_path):
    """multi_gpu.sh table-8b with SETS8B="0,1 2,3" (a stand-in for python records each fit):
    each variant's FSDP2 run gets one GPU pair, two at a time, every variant once."""
    calls = multi_gpu_calls(tmp_path, "table-8b", "$CUDA_VISIBLE_DEVICES|$*", SETS8B="0,1 2,3",
                            VARIANTS8B="bf16 fp8-delayed fp8-current")
    fits = [(gpus, args) for gpus, args in calls if " fit " in args]
    ran = sorted((gpus, "llama3_8b_bf16" in args, "recipe current" in args) for gpus, args in fits)
    # (the first two start together: their lines come in either order)
    assert ran == [("0,1", False, True), ("0,1", True, False), ("2,3", False, False)]
    assert all("--trainer.devices 2" in args for _, args in fits)


def test_the_two_gpu_table_runs_on_gpu_pairs_at_once(tmp_path):
    """multi_gpu.sh table-gpt2 with ONE_SETS="0 1 2 3" SETS="0,1 2,3" (a stand-in for python
    records each run): the one-GPU runs (plain script, FP8, BF16, Fabric) one per GPU, the
    two-GPU runs on the pairs, each pair with its own rendezvous port, every run once."""
    calls = multi_gpu_calls(tmp_path, "table-gpt2", "$CUDA_VISIBLE_DEVICES|$MASTER_PORT|$*",
                            ONE_SETS="0 1 2 3", SETS="0,1 2,3")
    runs = [call for call in calls
            if any(what in call[2] for what in ("plain_pytorch", " fit ", "fabric_train"))]

    def kind(args):
        what = ("plain" if "plain_pytorch" in args else "fabric" if "fabric_train" in args
                else "tensorwise" if "tensorwise" in args else "bf16" if "gpt2_bf16" in args
                else "fp8")
        two = "--nproc_per_node 2" in args or "devices 2" in args
        strategy = ("fsdp" if "fsdp" in args else "ddp" if "ddp" in args else "") if two else ""
        return what, strategy

    one = sorted((kind(args), gpus) for gpus, _, args in runs if "," not in gpus)
    assert one == [(("bf16", ""), "2"), (("fabric", ""), "3"), (("fp8", ""), "1"),
                   (("plain", ""), "0")]
    two = sorted(kind(args) for gpus, _, args in runs if "," in gpus)
    assert two == sorted([("plain", "ddp"), ("plain", "fsdp"), ("bf16", "ddp"), ("fp8", "ddp"),
                          ("fp8", "fsdp"), ("tensorwise", "fsdp"), ("fabric", "ddp"),
                          ("fabric", "fsdp")])
    pairs = {gpus: {port for g, port, _ in runs if g == gpus} for gpus, _, _ in runs if "," in gpus}
    assert set(pairs) == {"0,1", "2,3"} and len(pairs["0,1"] | pairs["2,3"]) == 2


def test_a_ddp_bucket_size_strategy_takes_a_whole_number_of_mb():
    """multi_gpu.sh's STRATEGIES entry ddp-bN: DDP's gradient buckets of N MB on top of
    configs/ddp.yaml; anything else after ddp-b is refused (status 1, a line on stderr)."""
    def strategy_args(name):
        return subprocess.run(
            ["bash", "-c", f'source <(sed -n "/^strategy_args()/,/^}}/p" scripts/multi_gpu.sh); '
                           f'strategy_args {name}'], cwd=ROOT, capture_output=True, text=True)

    good = strategy_args("ddp-b100")
    assert good.returncode == 0
    assert good.stdout.split() == ["configs/ddp.yaml",
                                   "--trainer.strategy.init_args.bucket_cap_mb", "100"]
    for bad in ("ddp-b1x", "ddp-b0", "ddp-b"):
        result = strategy_args(bad)
        assert result.returncode == 1 and result.stdout == "" and "ddp-bN" in result.stderr, bad


def test_a_table_with_single_0_runs_only_its_two_gpu_rows(tmp_path):
    """multi_gpu.sh table-gpt-1.3b-fsdp with SINGLE=0: the FSDP2 rows of the 1.3B table (plain
    script, FP8 TE, torchao tensorwise) and no one-GPU run."""
    calls = multi_gpu_calls(tmp_path, "table-gpt-1.3b-fsdp", "$*", SINGLE="0")
    runs = [args for (args,) in calls if "plain_pytorch" in args or " fit " in args]
    assert len(runs) == 3
    assert all("--nproc_per_node 2" in args or "--trainer.devices 2" in args for args in runs)
    assert all("fsdp" in args for args in runs)


def test_the_8b_memory_job_runs_each_checkpointing_at_4_and_8_layers(tmp_path):
    """multi_gpu.sh memory-8b (a stand-in for python records each fit): FP8 delayed under FSDP2
    on two GPUs, for each activation checkpointing of AC8B, the 8B shape cut to 4 and to 8
    layers."""
    calls = multi_gpu_calls(tmp_path, "memory-8b", "$*", AC8B="mlp full")
    fits = [args for (args,) in calls if " fit " in args]
    ran = [(a.split("--model.activation_checkpointing ")[1].split()[0],
            a.split("--model.config.n_layer ")[1].split()[0]) for a in fits]
    assert ran == [("mlp", "4"), ("mlp", "8"), ("full", "4"), ("full", "8")]
    assert all("llama3_8b_fp8" in a and "--trainer.devices 2" in a for a in fits)


def test_the_memory_summary_sets_the_estimate_against_the_peak_per_block(tmp_path, capsys):
    """memory-8b's logs: each run's estimate (the check's line) against its measured peak, and
    what a block adds to each (8 layers less 4, over 4)."""
    for layers, estimate, peak in ((4, 30.0, 36.0), (8, 34.0, 48.0)):
        (tmp_path / f"m8-mlp-l{layers}.log").write_text(
            "=== devices: 2\nmemory: estimated {:.1f} GiB per GPU (weights 1.0, gradients 1.0, "
            "optimizer 1.0, activations 1.0; peak: ...) of 79.1 GiB on H100\n"
            "memory: peak {:.1f} GiB in training (this GPU)\n".format(estimate, peak))
    summary_module().memory8b(tmp_path)
    out = capsys.readouterr().out
    assert "mlp   4 layers: estimate 30.0, peak 36.0 (0.83x)" in out
    assert "mlp   a block: estimate 1.00, measured 3.00" in out


def test_single_takes_0_or_1_and_refuses_anything_else(tmp_path):
    """multi_gpu.sh SINGLE=yes: one error line naming the variable and its values, status 2,
    nothing run."""
    result = subprocess.run(["bash", str(ROOT / "scripts" / "multi_gpu.sh"), "table-gpt2"],
                            capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, SINGLE="yes", OUT=str(tmp_path / "out"),
                                     PYTHON=str(stand_in_python(tmp_path, "$*")),
                                     CALLS=str(tmp_path / "calls.txt")))
    assert result.returncode == 2 and not (tmp_path / "calls.txt").exists()
    assert result.stderr.strip() == "error: SINGLE=yes; valid: 1 (the one-GPU runs too) or 0"


def test_the_8b_probe_runs_each_checkpointing_under_the_memory_probe(tmp_path):
    """multi_gpu.sh probe-8b: FP8 delayed at full depth under FSDP2 on two GPUs, per AC8B, its
    python started through scripts/memprobe.py (the output file named in MEMPROBE_OUT)."""
    calls = multi_gpu_calls(tmp_path, "probe-8b", "$MEMPROBE_OUT|$*", AC8B="mlp full")
    fits = [(out, args) for out, args in calls if " fit " in args]
    assert [(os.path.basename(out), args.split("--model.activation_checkpointing ")[1].split()[0])
            for out, args in fits] == [("p8-mlp.txt", "mlp"), ("p8-full.txt", "full")]
    assert all(args.startswith("scripts/memprobe.py -m fp8_lightning fit") for _, args in fits)
    assert all("--model.config.n_layer" not in args and "--trainer.devices 2" in args
               for _, args in fits)


def test_the_8b_seed_table_passes_t8_args_to_every_run(tmp_path):
    """multi_gpu.sh table-8b with T8_ARGS: each variant's run ends with those overrides."""
    calls = multi_gpu_calls(tmp_path, "table-8b", "$*", VARIANTS8B="fp8-delayed fp8-block",
                            T8_ARGS="--trainer.plugins.init_args.fp8_eval true")
    fits = [args for (args,) in calls if " fit " in args]
    assert len(fits) == 2
    assert all(args.endswith("--trainer.plugins.init_args.fp8_eval true") for args in fits)


def test_the_8b_jobs_run_the_3b_configs_and_preset_with_llama_3b(tmp_path):
    """LLAMA=3b: table-8b's package runs read configs/llama3_3b_*.yaml and its plain-script row
    builds the 3B preset; another value, or the jobs that reckon with the 8B's depth, are
    refused with one error line."""
    calls = multi_gpu_calls(tmp_path, "table-8b", "$*", LLAMA="3b",
                            VARIANTS8B="bf16 fp8-delayed plain-bf16")
    fits = [args for (args,) in calls if " fit " in args]
    assert [("llama3_3b_bf16.yaml" in a, "llama3_3b_fp8.yaml" in a) for a in fits] == [
        (True, False), (False, True)]
    (plain,) = [args for (args,) in calls if "plain_pytorch" in args]
    assert "--model llama3.2-3b " in plain
    for job, llama, said in (("table-8b", "70b", "error: LLAMA=70b; valid: 8b or 3b"),
                             ("scaling-8b", "3b", "error: scaling-8b runs the 8B only")):
        refused = subprocess.run(["bash", str(ROOT / "scripts" / "multi_gpu.sh"), job],
                                 capture_output=True, text=True, timeout=60,
                                 env=dict(os.environ, LLAMA=llama, OUT=str(tmp_path / "o2"),
                                          PYTHON=str(stand_in_python(tmp_path, "$*"))))
        assert refused.returncode == 2 and said in refused.stderr, refused.stderr


def test_an_empty_gpus_list_runs_only_the_one_gpu_rows(tmp_path):
    """GPUS= (set, empty): throughput's one-GPU run of each precision, no several-GPU run."""
    calls = multi_gpu_calls(tmp_path, "throughput-gpt-1.3b", "$*", GPUS="", PRECISIONS="fp8")
    fits = [args for (args,) in calls if " fit " in args]
    assert len(fits) == 1 and "--trainer.devices 1 " in fits[0]


def test_the_8b_seed_table_s_bf16ends_variants_keep_the_first_and_last_block_in_bf16(tmp_path):
    """table-8b's -bf16ends variants: their recipe, with one BF16 block at each end."""
    calls = multi_gpu_calls(tmp_path, "table-8b", "$*",
                            VARIANTS8B="fp8-delayed-bf16ends fp8-current-bf16ends")
    fits = [args for (args,) in calls if " fit " in args]
    plugin = "--trainer.plugins.init_args"
    assert [f"{plugin}.recipe delayed " in a for a in fits] == [True, False]
    assert [f"{plugin}.recipe current " in a for a in fits] == [False, True]
    assert all(f"{plugin}.bf16_first_layers 1 {plugin}.bf16_last_layers 1" in a for a in fits)


def test_the_memory_probe_groups_live_blocks_by_where_they_were_made():
    """scripts/memprobe.py's summary of a memory snapshot: only live blocks count, grouped by
    the innermost telling frame and the package frame that called it, largest first."""
    probe = load_script("scripts/memprobe.py")

    def frames(*where):
        return [{"filename": f, "line": n, "name": name} for f, n, name in where]

    mlp = frames(("/x/transformer_engine/pytorch/module/layernorm_mlp.py", 500, "forward"),
                 ("/x/fp8_lightning/model.py", 150, "residual"))
    head = frames(("/x/torch/nn/functional.py", 10, "linear"), ("/x/fp8_lightning/model.py", 300,
                                                                  "forward"))
    gib = probe.GIB
    snapshot = {"segments": [{"blocks": [
        {"state": "active_allocated", "size": gib, "frames": mlp},
        {"state": "active_allocated", "size": gib, "frames": mlp},
        {"state": "inactive", "size": 5 * gib, "frames": mlp},
        {"state": "active_allocated", "size": gib // 2, "frames": head}]}]}
    lines = probe.summary(snapshot, "out of memory").splitlines()
    assert lines[0] == "out of memory: 2.50 GiB live in 3 blocks"
    assert lines[2].split() == ["2.000", "2", "transformer_engine:pytorch/module/layernorm_mlp.py:500",
                                "forward", "<-", "fp8_lightning:model.py:150", "residual"]
    assert lines[3].split()[:3] == ["0.500", "1", "fp8_lightning:model.py:300"]


@pytest.mark.parametrize("fraction", ["abc", "0", "1.5"])
def test_the_memory_probe_refuses_a_share_of_the_gpu_it_cannot_take(fraction):
    result = subprocess.run([sys.executable, "scripts/memprobe.py", "-m", "json.tool", "--help"],
                            cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "MEMPROBE_FRACTION": fraction})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (f"error: MEMPROBE_FRACTION={fraction}; valid: a number in "
                                     "(0, 1]")


def test_a_run_cut_by_a_limit_on_the_script_ends_with_it(tmp_path):
    """multi_gpu.sh under an outer timeout (a time limit on the whole job): the run it had started (a
    stand-in python that sleeps) ends with the script instead of holding the GPUs, and its log
    is archived."""
    calls = tmp_path / "calls.txt"
    archive = tmp_path / "logs.tar"
    subprocess.run(["timeout", "3", "bash", str(ROOT / "scripts" / "multi_gpu.sh"), "probe-8b"],
                   capture_output=True, timeout=60,
                   env=dict(os.environ, CALLS=str(calls), OUT=str(tmp_path / "out"),
                            ARCHIVE=str(archive),
                            PYTHON=str(stand_in_python(tmp_path, "$$|$*", pause="60")),
                            DATA8K=str(prepared_corpus(tmp_path, "d8"))))
    pids = [int(pid) for pid, args in (line.split("|") for line in calls.read_text().splitlines())
            if " fit " in args]
    assert len(pids) == 1
    for _ in range(50):  # the group's TERM is sent at once; give it a moment
        if not os.path.exists(f"/proc/{pids[0]}"):
            break
        subprocess.run(["sleep", "0.1"])
    assert not os.path.exists(f"/proc/{pids[0]}")
    assert "p8-mlp.log" in subprocess.run(["tar", "tf", str(archive)], capture_output=True,
                                          text=True).stdout


def test_the_8b_evaluation_job_runs_the_fp8_eval_values_asked(tmp_path):
    """multi_gpu.sh eval-8b: BF16 then FP8 evaluation by default; EVAL8B=true runs only FP8's."""
    def evals(**env):
        where = tmp_path / str(len(env))
        where.mkdir()
        calls = multi_gpu_calls(where, "eval-8b", "$*", **env)
        return [a.split("--trainer.plugins.init_args.fp8_eval ")[1].split()[0]
                for (a,) in calls if " fit " in a]

    assert evals() == ["false", "true"]
    assert evals(EVAL8B="true") == ["true"]


def test_a_term_to_the_script_alone_ends_the_runs_it_started_at_once(tmp_path):
    """multi_gpu.sh table-8b with SETS8B (two runs at once in background jobs), then a TERM to
    the script's process only: it ends both runs before it exits."""
    calls = tmp_path / "calls.txt"
    script = subprocess.Popen(
        ["bash", str(ROOT / "scripts" / "multi_gpu.sh"), "table-8b"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=dict(os.environ, CALLS=str(calls), OUT=str(tmp_path / "out"), SETS8B="0,1 2,3",
                 VARIANTS8B="bf16 fp8-delayed",
                 PYTHON=str(stand_in_python(tmp_path, "$$|$*", pause="60")),
                 DATA8K=str(prepared_corpus(tmp_path, "d8"))))
    try:
        for _ in range(100):  # both runs started
            lines = calls.read_text().splitlines() if calls.exists() else []
            runs = [line for line in lines if " fit " in line]
            if len(runs) == 2:
                break
            subprocess.run(["sleep", "0.1"])
        assert len(runs) == 2
        script.terminate()
        assert script.wait(timeout=30) == 143
        pids = [int(line.split("|")[0]) for line in runs]
        assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
    finally:
        script.kill()


def test_the_8b_table_s_plain_script_row_runs_its_loop_and_sets_the_baseline_when_faster(
        tmp_path, capsys):
    """table-8b's plain-bf16 variant runs benchmarks/plain_pytorch.py under torchrun (FSDP2, the
    configs' mlp checkpointing, speed only); the summary takes the faster BF16 (package or plain
    script) as the speedup's baseline and the package's BF16 for the val loss."""
    calls = multi_gpu_calls(tmp_path, "table-8b", "$*", VARIANTS8B="plain-bf16")
    (plain_args,) = [a for (a,) in calls if "plain_pytorch" in a]
    assert plain_args.startswith("-m torch.distributed.run --nproc_per_node 2")
    assert "--model llama3-8b --batch_size 1 --strategy fsdp --activation_checkpointing mlp" \
        in plain_args

    out = tmp_path / "logs"
    out.mkdir()

    def monitor_log(name, ms, val):
        tok_s = round(2 * 8192 / ms * 1000)
        (out / f"t8-{name}.log").write_text(
            "=== devices: 2\n" + "".join(
                f"step {s} | loss 4.0 | lr 1e-4 | norm 1.0 | dt {ms}ms | tok/s {tok_s:,} | "
                f"mfu 40.0% | x\n" for s in (5, 10, 15, 20)) +
            f"step 20 | val/loss {val} | val/ppl 1 | peak mem 40.0 GiB (training 60.0 GiB)\n"
            "memory: peak 60.0 GiB in training, 40.0 GiB in validation (this GPU)\n")

    monitor_log("bf16", 1200.0, 5.0)
    monitor_log("fp8-delayed", 800.0, 5.05)
    (out / "t8-plain-bf16.log").write_text("=== devices: 2\n" + json.dumps(
        {"script": "plain_pytorch", "gpus": 2, "ms_per_step": 1000.0, "tok_s_per_gpu": 8192,
         "mfu_pct": 48.0, "peak_mem_gib": 61.0}) + "\n")
    summary_module().main8b(out)
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith("  ") and "variant" not in line}
    assert rows["plain-bf16"][1:4] == ["1.000", "8,192", "1.00x"]
    assert rows["bf16"][3] == "0.83x"
    assert rows["fp8-delayed"][3] == "1.25x"  # over the plain script's 1.000 s/it
    assert rows["fp8-delayed"][-1] == "+1.00%"  # val loss against the package's BF16


def test_the_plain_script_refuses_a_depth_or_checkpointing_it_cannot_run():
    """benchmarks/plain_pytorch.py --n_layer 0 or an unknown --activation_checkpointing: exit
    2 with an error line naming the flag, before any GPU work."""
    for bad in (["--n_layer", "0"], ["--activation_checkpointing", "some"]):
        result = subprocess.run([sys.executable, "benchmarks/plain_pytorch.py", *bad], cwd=ROOT,
                                capture_output=True, text=True, timeout=120)
        errors = [line for line in result.stderr.splitlines() if "error:" in line]
        assert result.returncode == 2 and len(errors) == 1 and bad[0] in errors[0], result.stderr
        assert "Traceback" not in result.stderr


def test_the_8b_resume_check_runs_at_the_steps_asked_and_sets_the_gap_against_the_spread(
        tmp_path, capsys):
    """resume-8b with R8_AT=30 R8_TO=40: two whole runs to 40, one to 30 checkpointing at 30 on
    disk under R8_ROOT, resumed from it to 40; the summary gives the resumed run's gap to the
    whole run (worst and mean over 31..40) beside the two whole runs' (the spread)."""
    root = tmp_path / "ckpts"
    calls = multi_gpu_calls(tmp_path, "resume-8b", "$*", R8_AT="30", R8_TO="40",
                            R8_ROOT=str(root))
    fits = [a for (a,) in calls if " fit " in f" {a} "]
    assert len(fits) == 4 and all("--model.lr_decay_steps 40" in a for a in fits)
    assert [a.split("--trainer.max_steps ")[1].split()[0] for a in fits] == ["40", "40", "30", "40"]
    assert f"--ckpt_path {root}/r8-first/checkpoints/last.ckpt" in fits[3]
    with tarfile.open(tmp_path / "out" / "multi_gpu_logs.tgz") as logs:  # the job's files
        config = next(m for m in logs.getmembers() if m.name.endswith("resume8b.yaml"))
        assert "every_n_train_steps: 30" in logs.extractfile(config).read().decode()

    out = tmp_path / "logs"
    out.mkdir()
    for name, losses in (("whole", [4.0] * 40), ("again", [4.0] * 30 + [4.4] * 10),
                         ("resumed", [None] * 30 + [4.2] * 9 + [4.0])):
        (out / f"r8-{name}.log").write_text("".join(
            f"step {s} | loss {loss} | lr 1e-4 | norm 1.0 | dt 700.0ms | tok/s 23,000 | "
            "mfu 60.0% | x\n"
            for s, loss in enumerate(losses, 1) if loss is not None))
    summary_module().main8b(out)
    text = capsys.readouterr().out
    assert ("8B resume from the sharded step-30 checkpoint: 10 steps compared (31..40); relative "
            "loss gap at the first 5.00e-02, worst 5.00e-02, mean 4.50e-02") in text
    assert "two uninterrupted runs over the same steps: relative gap worst 1.00e-01, mean " \
        "1.00e-01 (the run-to-run spread)" in text


@pytest.mark.parametrize("at, to", [("abc", "19"), ("0", "19"), ("19", "19"), ("30", "x")])
def test_the_8b_resume_check_refuses_steps_it_cannot_run(at, to):
    """R8_AT / R8_TO not whole numbers with 1 <= R8_AT < R8_TO: one error line, exit 2, before
    any run or data preparation."""
    result = subprocess.run(["bash", str(ROOT / "scripts" / "multi_gpu.sh"), "resume-8b"],
                            capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, R8_AT=at, R8_TO=to, PYTHON="false"))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == (f"error: R8_AT={at} R8_TO={to}; valid: whole numbers, "
                                     "1 <= R8_AT < R8_TO")
