"""The benchmark harness (``python -m benchmarks.harness``) on CPU: every job's plan builds from
existing configs, scripts and flags its tools accept, in parse_variant's vocabulary; the plan's
GPU sets and ports; a run's time limit and a stop end its process group and keep its log; the
summary reads logs in the package's own line formats into the docs' tables."""

import importlib.util
import inspect
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from benchmarks import harness, jobs, summary, variants
from tests._runs import ROOT, run_main


def plan(*argv, tmp_path=None):
    """The plan of ``python -m benchmarks.harness ARGV`` (OUT under tmp_path)."""
    out = ["--out", str(tmp_path / "out")] if tmp_path else []
    return jobs.build_plan(harness.parser().parse_args([*argv, *out]))


def by_name(p):
    return {run.name: run for run in p.runs}


# --------------------------------------------------------------------------------- plans
def test_every_job_s_plan_names_configs_scripts_and_flags_that_exist(tmp_path):
    """Each job's runs: their --config files exist (or the plan writes them), their scripts and
    modules exist, and every flag of bench, doctor, the plain script and the Fabric example is
    one the tool takes; a corpus is prepared once, before the first run that reads it."""
    from examples.fabric_train import parse_args
    from fp8_lightning.commands.bench import bench
    from fp8_lightning.commands.doctor import doctor

    plain_flags = set(re.findall(r'add_argument\("(--\w+)"',
                                 (ROOT / "benchmarks/plain_pytorch.py").read_text()))
    takes = {"bench": set(inspect.signature(bench).parameters) | {"config"},
             "doctor": set(inspect.signature(doctor).parameters) | {"config"}}
    for job in jobs.JOBS:
        p = plan(job, tmp_path=tmp_path)
        assert p.runs, job
        for run in p.runs:
            argv = run.argv
            for i, arg in enumerate(argv[:-1]):
                if arg == "--config":
                    path = argv[i + 1]
                    assert (ROOT / path).exists() or os.path.basename(path) in p.files, (job, path)
            if argv[1].endswith(".py"):
                assert (ROOT / argv[1]).exists(), (job, argv)
            if argv[1:3] == ["-m", "torch.distributed.run"]:
                assert (ROOT / argv[5]).exists()
            if argv[1] == "-m":
                assert importlib.util.find_spec(argv[2]) is not None, argv[2]
            if "benchmarks/plain_pytorch.py" in argv:
                used = {a for a in argv if a.startswith("--") and a != "--nproc_per_node"}
                assert used <= plain_flags, used - plain_flags
            if argv[1:3] == ["-m", "examples.fabric_train"]:
                parse_args(argv[3:])  # exits on a flag it does not take
            if argv[1:4] in (["-m", "fp8_lightning", "bench"], ["-m", "fp8_lightning", "doctor"]):
                used = {a[2:] for a in argv[4:] if a.startswith("--")}
                assert used <= takes[argv[3]], used - takes[argv[3]]
        prepared = [run.name for run in p.runs if run.name.startswith("prepare-")]
        assert len(prepared) == len(set(prepared)) <= 1


def test_variants_are_parse_variant_s_names_and_others_are_refused(tmp_path, capsys):
    """Every variant a job names parses with fp8_lightning.measure.parse_variant (a tool prefix,
    plain: or fabric:, runs it elsewhere); the old scripts' names are refused in one line."""
    from fp8_lightning.measure import parse_variant

    for job in jobs.JOBS.values():
        for name in [*job.variants, *(row.variant for row in job.rows)]:
            parse_variant(variants.split_tool(name)[1])
            variants.check_variant(name)
    for old in ("fp8", "bf16", "fp8-head", "delayed-nograph", "plain-bf16", "fp8-tensorwise-ag"):
        code = harness.main(["table-8b", "--variants", old, "--dry-run", "--out",
                             str(tmp_path)])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    for bad in ("plain:fp8-delayed", "fabric:torch-compile", "fabric:fp8-delayed-te-attn"):
        with pytest.raises(variants.UsageError):
            variants.check_variant(bad)


def test_a_variant_overrides_its_config_only_where_it_differs_from_it(tmp_path):
    """The shipped configs are their variants as they stand (no override); other variants
    change only what their names say; a recipe given as a mapping is read by its name."""
    o = variants.variant_overrides
    assert o("fp8-delayed-te-attn", "configs/gpt2_fp8.yaml") == []
    assert o("fp8-delayed-recent-te-attn", "configs/gpt2_fp8.yaml") == []  # what it ships
    assert o("torch-compile", "configs/gpt2_bf16.yaml") == []
    assert o("fp8-delayed-bf16ends-te-attn-ac-mlp", "configs/llama3_8b_fp8.yaml") == []
    assert o("torch-compile", "configs/llama3_3b_bf16.yaml") == []
    plugin = "--trainer.plugins.init_args"
    assert o("fp8-delayed-hist1024-te-attn", "configs/gpt2_fp8.yaml") == [  # TE's default history
        f"{plugin}.recipe", "{name: delayed, amax_history_len: 1024, amax_compute_algo: max}"]
    assert o("fp8-tensorwise", "configs/gpt2_fp8.yaml") == [
        "--model.attention", "sdpa", f"{plugin}.recipe", "tensorwise"]
    assert o("fp8-delayed-te-attn-ac-mlp", "configs/llama3_8b_fp8.yaml") == [
        f"{plugin}.bf16_first_layers", "0", f"{plugin}.bf16_last_layers", "0"]
    assert o("fp8-delayed-te-attn-nograph", "configs/gpt2_fp8.yaml") == [
        "--model.cuda_graphs", "false"]
    assert o("te-bf16-eager", "configs/gpt2_bf16.yaml") == [
        "--model.backend", "te", "--model.compile", "false"]
    assert o("fp8-delayed", "configs/gpt2_fp8.yaml") == ["--model.attention", "sdpa"]
    mapping = tmp_path / "fp8.yaml"
    mapping.write_text((ROOT / "configs/gpt2_fp8.yaml").read_text().replace(
        "recipe:\n          name: delayed\n          amax_history_len: 1\n          amax_compute_algo: "
        "most_recent", "recipe: {name: delayed, amax_history_len: 16}"))
    assert o("fp8-delayed-te-attn", str(mapping)) == []
    assert o("fp8-current-te-attn", str(mapping)) == [f"{plugin}.recipe", "current"]
    assert o("fp8-delayed-fp8-attn", str(mapping)) == [
        f"{plugin}.recipe", "{name: delayed, amax_history_len: 16, fp8_dpa: true}"]
    assert o("fp8-current-fp8-attn", "configs/gpt2_fp8.yaml") == [
        f"{plugin}.recipe", "{name: current, fp8_dpa: true}"]
    assert o("fp8-delayed-recent-te-attn", str(mapping)) == [  # the config's history replaced
        f"{plugin}.recipe", "{name: delayed, amax_history_len: 1, amax_compute_algo: most_recent}"]


def doc_commands():
    """Every ``python -m benchmarks.harness ...`` of the README and docs/ (bash blocks and inline),
    as its arguments."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        lines = [line for block in re.findall(r"```bash\n(.*?)```", text, re.S)
                 for line in block.replace("\\\n", " ").splitlines()]
        lines += [m.replace("\n", " ")
                  for m in re.findall(r"`(python -m benchmarks\.harness\s[^`]+)`", text)]
        for line in lines:
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # CUDA_VISIBLE_DEVICES=0,1 ...
                words.pop(0)
            if words[:3] == ["python", "-m", "benchmarks.harness"] and words[3:4] != ["JOB..."]:
                found.append((path.name, words[3:]))
    return found


def test_every_harness_command_of_the_docs_plans(tmp_path):
    """Each harness command the README and docs/ show builds its plan (jobs, variants,
    strategies and options the harness takes)."""
    commands = doc_commands()
    assert len(commands) > 25
    for doc, argv in commands:
        try:
            plan(*argv, tmp_path=tmp_path)
        except (variants.UsageError, SystemExit) as err:
            raise AssertionError(f"{doc}: {shlex.join(argv)}: {err}") from None


# one run of each kind of override: strategies, variants' plugin and model settings, the loss,
# resume and 8B runs' own settings
CHECKED = {
    ("table-gpt2",): ["tp-gpt2-fp8-tensorwise-fsdp-2gpu", "tp-gpt2-torch-compile-ddp-2gpu"],
    ("throughput-gpt-1.3b", "--strategies", "ddp-bf16grad-b50,fsdp-keep-g4-r2-eager",
     "--variants", "te-bf16-fp32res,fp8-delayed-fp8-attn-fp8-head-te-attn-nograph,"
     "fp8-tensorwise-alllayers-bf16res"): [
        "tp-gpt-1.3b-te-bf16-fp32res-ddp-bf16grad-b50-2gpu",
        "tp-gpt-1.3b-fp8-delayed-fp8-attn-fp8-head-te-attn-nograph-fsdp-keep-g4-r2-eager-2gpu",
        "tp-gpt-1.3b-fp8-tensorwise-alllayers-bf16res-1gpu"],
    ("loss-gpt2",): ["loss-1gpu", "loss-fsdp-4gpu", "loss-fsdp-4gpu-resumed"],
    ("table-8b", "eval-8b", "resume-8b", "--llama", "3b", "--layers", "2",
     "--extra=--trainer.plugins.init_args.fp8_eval true"): [
        "t8-fp8-current-bf16ends-te-attn-ac-mlp-2gpu", "e8-fp8eval-true", "r8-first"],
}


def test_the_fit_overrides_of_representative_runs_are_ones_the_cli_takes(tmp_path, capsys):
    """``fit --print_config`` with a run's arguments (on CPU, nothing trains) for one run of
    each kind of override: every key is one the package CLI takes."""
    for argv, names in CHECKED.items():
        p = plan(*argv, tmp_path=tmp_path)
        p.out.mkdir(parents=True, exist_ok=True)
        for name, text in p.files.items():
            (p.out / name).write_text(text)
        runs = by_name(p)
        for name in names:
            fit = runs[name].argv
            assert fit[1:4] == ["-m", "fp8_lightning", "fit"], fit
            code, _, err = run_main(capsys, [*fit[3:], "--print_config"])
            assert code == 0, f"{name}: {err[-1500:]}"


def test_a_job_runs_what_its_old_script_ran():
    """Spot checks against the replaced scripts: the loss job's global batch and emulated ranks,
    the 8B table's plain row under torchrun with the configs' checkpointing, the probe under
    scripts/memprobe.py, bench's model and micro-batch, the environment every run gets."""
    runs = by_name(plan("loss-gpt2", "--gpus", "2"))
    one = " ".join(runs["loss-1gpu"].argv)
    assert "--data.batch_size 16 --trainer.accumulate_grad_batches 2 --data.emulate_ranks 2" in one
    assert "--data.batch_size 16" in " ".join(runs["loss-ddp-2gpu"].argv)
    assert runs["generate"].needs == (os.path.abspath("bench_out/consolidated.ckpt"),)
    runs = by_name(plan("table-8b", "--variants", "plain:torch-compile-ac-mlp", "--gpus", "2"))
    (plain,) = [r for r in runs.values() if "plain_pytorch" in " ".join(r.argv)]
    assert " ".join(plain.argv[1:]).startswith("-m torch.distributed.run --nproc_per_node 2 "
                                               "benchmarks/plain_pytorch.py --model llama3-8b "
                                               "--batch_size 1 --strategy fsdp "
                                               "--activation_checkpointing mlp --warmup 20")
    assert plain.argv[-2:] == ["--steps", "60"]
    probe = by_name(plan("probe-8b", "--variants", "fp8-delayed-te-attn-ac-full"))
    run = probe["p8-fp8-delayed-te-attn-ac-full"]
    assert run.argv[1:5] == ["scripts/memprobe.py", "-m", "fp8_lightning", "fit"]
    assert run.env["MEMPROBE_OUT"].endswith("p8-fp8-delayed-te-attn-ac-full.txt")
    assert "--model.activation_checkpointing full" in " ".join(run.argv)
    bench = by_name(plan("bench-llama3-8b", "--steps", "10"))["bench-llama3-8b"].argv
    assert " ".join(bench).endswith("--model llama3-8b --n_layer 4 --batch_size 1 --seq_len 8192")
    assert harness.ENV == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                           "NVSHMEM_DISABLE_NVLS": "1"}


def test_options_a_job_does_not_take_leave_it_as_it_is():
    """--steps and --variants of a call go to the jobs that take them: eval-8b keeps its 20
    steps, table-gpt2 its rows; --gpus 2 leaves a table its two-GPU rows; bad input is refused."""
    runs = by_name(plan("eval-8b", "table-8b", "--steps", "8", "--gpus", "1",
                        "--variants", "fp8-tensorwise-ac-mlp"))
    assert "--trainer.max_steps 20" in " ".join(runs["e8-fp8eval-false"].argv)
    assert "--trainer.max_steps 8" in " ".join(runs["t8-fp8-tensorwise-ac-mlp-1gpu"].argv)
    rows = [r for r in plan("table-gpt-1.3b-fsdp", "--gpus", "2").runs if r.gpus]
    assert len(rows) == 4 and all(r.gpus == 2 and "fsdp" in " ".join(r.argv) for r in rows)
    for argv in (["nojob"], ["resume-8b", "--resume-at", "19"], ["table-gpt2", "--sets", "a"],
                 ["throughput-gpt2", "--strategies", "ddp-b0"],
                 ["throughput-gpt2", "--strategies", "fsdp-r0"]):
        with pytest.raises(variants.UsageError):
            plan(*argv)


# --------------------------------------------------------------------------------- scheduling
def test_the_two_gpu_table_runs_on_gpu_sets_at_once_each_pair_with_its_port():
    """table-gpt2 with --sets 0 1 2 3 0,1 2,3: the four one-GPU runs at once, one a GPU, then the
    two-GPU runs two at a time on the pairs, each pair with its own port; every run once."""
    p = plan("table-gpt2", "--sets", "0", "1", "2", "3", "0,1", "2,3")
    waves = harness.waves(p.runs, p.sets)
    gpu_waves = [w for w in waves if w[0][0].gpus]
    assert [[s for _, s, _ in w] for w in gpu_waves] == \
        [["0", "1", "2", "3"]] + [["0,1", "2,3"]] * 4 + [["0,1"]]
    assert {port for w in gpu_waves[1:] for _, _, port in w} == {29640, 29650}
    ran = [r.name for w in waves for r, _, _ in w]
    assert sorted(ran) == sorted(r.name for r in p.runs)
    # without --sets a table's one-GPU runs go two at a time; its two-GPU runs one after another
    p = plan("table-gpt-1.3b")
    assert [len(w) for w in harness.waves(p.runs, p.sets) if w[0][0].gpus] == [2, 1] + [1] * 7
    # dependent runs go alone whatever the sets
    p = plan("resume-gpt2", "--sets", "0,1,2,3")
    assert all(len(w) == 1 for w in harness.waves(p.runs, p.sets))
    assert harness.physical("1,2", "4,5,6,7") == "5,6" and harness.physical("0", None) == "0"


# --------------------------------------------------------------------------------- execution
def sleeper(name, seconds, gpus=1, **kw):
    """A run that prints its GPUs and port, starts a child in its group, and sleeps."""
    code = ("import os, subprocess, sys, time; "
            "print(os.environ.get('CUDA_VISIBLE_DEVICES'), os.environ.get('MASTER_PORT'), "
            "flush=True); child = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(60)']); print('child', child.pid, flush=True); "
            f"time.sleep({seconds})")
    return jobs.Run(name, [sys.executable, "-c", code], gpus, {"section": "x"}, **kw)


def child_pid(log):
    return int(re.search(r"^child (\d+)$", log.read_text(), re.M)[1])


def gone(pid, wait=5.0):
    end = time.monotonic() + wait
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_runs_go_on_their_sets_and_one_past_its_limit_ends_with_its_group(tmp_path):
    """Two runs on two sets at once, each with its set and port in its environment; the one past
    its time limit exits 124 with every process of its group ended; both logs keep their lines
    and end with the exit line; a run whose input is missing is not run; clean-up paths go."""
    junk = tmp_path / "out" / "x.ckpt"
    junk.parent.mkdir()
    junk.write_text("x")
    p = jobs.Plan(tmp_path / "out", [sleeper("quick", 0.2, clean=(str(junk),)),
                                        sleeper("slow", 30, timeout=1.0),
                                        sleeper("after", 0, needs=(str(tmp_path / "none"),))],
                     sets=("3", "5"))
    start = time.monotonic()
    assert harness.execute(p, visible=8, poll=0.05) == 0
    assert time.monotonic() - start < 10
    quick, slow = (tmp_path / "out" / f"{n}.log" for n in ("quick", "slow"))
    assert "\n3 29600\n" in quick.read_text() and "\n5 29610\n" in slow.read_text()
    assert quick.read_text().rstrip().splitlines()[-1].startswith("=== quick: exit 0 after")
    assert slow.read_text().rstrip().splitlines()[-1].startswith("=== slow: exit 124 after")
    assert gone(child_pid(slow)) and not junk.exists()
    assert not (tmp_path / "out" / "after.log").exists()
    assert json.loads(quick.read_text().splitlines()[0][len("=== run "):])["name"] == "quick"


def test_a_term_to_the_harness_ends_its_runs_and_keeps_their_logs(tmp_path):
    """A TERM to the harness's process alone: every run it started ends (its group with it), the
    finished run's log and the stopped ones' logs stay, and the harness exits 143."""
    script = (
        "import sys; from pathlib import Path; from benchmarks import harness, jobs; "
        "from tests.test_harness import sleeper; "
        f"out = Path({str(tmp_path / 'out')!r}); "
        "p = jobs.Plan(out, [sleeper('done', 0), sleeper('a', 60), sleeper('b', 60), "
        "sleeper('later', 0)], sets=('0', '1')); "
        "p.runs[0].alone = True; sys.exit(harness.execute(p, visible=2, poll=0.05))")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    out = tmp_path / "out"
    started = False
    for _ in range(600):
        started = all((out / f"{n}.log").exists() and re.search(
            r"^child \d+$", (out / f"{n}.log").read_text(), re.M) for n in ("a", "b"))
        if started:
            break
        time.sleep(0.05)
    assert started
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    for name in ("a", "b"):
        log = out / f"{name}.log"
        assert gone(child_pid(log)) and f"=== {name}: exit 124" in log.read_text()
    assert "exit 0" in (out / "done.log").read_text() and not (out / "later.log").exists()
    assert "later: not run: stopped" in proc.stdout.read()


# --------------------------------------------------------------------------------- summary
def monitor_lines(times, mfus=None, batch_tokens=2 * 16 * 1024, precision="FP8 delayed"):
    """TrainingMonitor's console lines, as the package formats them."""
    from fp8_lightning.callbacks.monitor import format_line

    return [format_line(step, 4.0, 1e-4, 1.0, ms, batch_tokens / ms * 1000,
                        (mfus or {}).get(step, 0.2), 0.01, precision) for step, ms in times.items()]


def write_log(out, name, about, lines, code=0):
    about = {"name": name, **about}
    (out / f"{name}.log").write_text(
        f"=== run {json.dumps(about)}\n=== command: python ...\n" + "\n".join(lines)
        + f"\n=== {name}: exit {code} after 60 s\n")


def profile_table(first, ranks):
    from fp8_lightning.callbacks.profile import FIELDS, format_split

    return format_split([dict(zip(FIELDS, (40.0 + r, 30.0, 1.0, 9.0 + r, 3.0, 0.5)))
                         for r in range(ranks)], first, 5).splitlines()


def test_the_median_keeps_the_lines_before_the_profile_and_after_the_first_two(tmp_path):
    """Steps 60-64 profiled: the monitor's line at 70 holds them and every later step runs slower
    where the host sets the pace (CUPTI stays attached after the profiler: pytorch/pytorch#144455),
    so only the lines before are kept, without the first two (compilation, warm-up)."""
    times = {10: 400.0, 20: 90.0, 30: 60.0, 40: 64.0, 50: 62.0, 60: 61.0, 70: 180.0, 80: 100.0,
             90: 99.0}
    mfus = {10: 0.02, 20: 0.09, 30: 0.21, 40: 0.195, 50: 0.205, 60: 0.208, 70: 0.07, 80: 0.12,
            90: 0.121}
    lines = monitor_lines(times, mfus)
    lines[6:6] = profile_table(60, 2)
    about = {"section": "gpt2", "tool": "fit", "variant": "fp8-delayed-te-attn",
             "strategy": "fsdp", "gpus": 2, "fp8": True}
    write_log(tmp_path, "tp", about, lines)
    run = summary.read(tmp_path / "tp.log")
    assert run["ms"] == 61.5 and run["mfu"] == "20.5%" and run["gpus"] == 2
    write_log(tmp_path, "tp", about, monitor_lines(times, mfus))
    assert summary.read(tmp_path / "tp.log")["ms"] == 64.0  # 60, 64, 62, 61, 180, 100, 99


def test_the_gpt_table_scales_each_run_by_its_one_gpu_and_compares_with_the_fastest_bf16(
        tmp_path):
    """A table's logs (fit, the plain script's JSON line, the Fabric example's lines): tok/s per
    GPU, scaling over the same run's one GPU, the ratio over the fastest BF16 of the same
    strategy and GPU count (the plain script here), StepProfile's rows per rank."""
    def fit(name, variant, strategy, gpus, ms, fp8=True, profile=False):
        lines = monitor_lines({s: ms for s in range(10, 101, 10)}, batch_tokens=gpus * 16 * 1024)
        if profile:
            lines[8:8] = profile_table(90, gpus)
        write_log(tmp_path, name, {"section": "gpt2", "tool": "fit", "variant": variant,
                                   "strategy": strategy, "gpus": gpus, "fp8": fp8}, lines)

    fit("a", "fp8-delayed-te-attn", "single", 1, 32.0)
    fit("b", "fp8-delayed-te-attn", "ddp", 2, 40.0, profile=True)
    fit("c", "torch-compile", "ddp-bf16grad", 2, 50.0, fp8=False)
    plain = {"script": "plain_pytorch", "gpus": 2, "ms_per_step": 45.0, "tok_s_per_gpu": 364089,
             "mfu_pct": 30.0, "peak_mem_gib": 9.0}
    write_log(tmp_path, "d", {"section": "gpt2", "tool": "plain", "variant": "torch-compile",
                              "strategy": "ddp", "gpus": 2, "fp8": False}, [json.dumps(plain)])
    write_log(tmp_path, "e", {"section": "gpt2", "tool": "fabric", "variant": "fp8-delayed",
                              "strategy": "ddp", "gpus": 2, "fp8": True},
              [f"step {s:>5} | loss 5.0000 | lr 6.00e-04 | 55 ms/step | tok/s per GPU 297,600 | "
               "fp8-delayed" for s in range(10, 101, 10)])
    write_log(tmp_path, "f", {"section": "gpt2", "tool": "fit", "variant": "fp8-tensorwise",
                              "strategy": "fsdp", "gpus": 2, "fp8": True}, ["Traceback ..."], 1)
    text = summary.summarize(tmp_path)
    rows = {" ".join(line.split()[:2]): line.split() for line in text.splitlines()
            if "per GPU  scaling" in line}
    assert rows["fp8-delayed-te-attn ddp-2gpu"][2:] == [
        "409,600", "per", "GPU", "scaling", "0.80", "vs", "BF16", "1.12x", "mfu", "20.0%"]
    assert rows["torch-compile ddp-bf16grad-2gpu"][6] == "-"  # no one-GPU run of it
    assert rows["torch-compile ddp-bf16grad-2gpu"][9] == "0.90x"
    assert rows["plain:torch-compile ddp-2gpu"][2] == "364,089"
    assert rows["fabric:fp8-delayed ddp-2gpu"][2] == "297,600"
    assert "profile b: rank 1: step 41.00 = compute 30.00 + exposed comm 1.00 + idle 10.00 " \
        "(comm 3.00)" in text
    assert "f: no step lines (see its log)" in text and "did not exit 0 (see their logs): f" in text


def test_the_llama_table_takes_the_faster_bf16_for_speed_and_the_package_s_for_the_loss(
        tmp_path):
    """table-8b's logs: the speedup over the faster BF16 (here the plain script), the val loss
    against the package's BF16; then the resume check against the run-to-run spread."""
    def llama(name, variant, ms, val, fp8):
        lines = monitor_lines({s: ms for s in (5, 10, 15, 20)}, batch_tokens=2 * 8192)
        lines += [f"step 20 | val/loss {val:.4f} | val/ppl 1.00 | peak mem 40.0 GiB (training "
                  "60.0 GiB)", "memory: peak 60.0 GiB in training, 40.0 GiB in validation "
                  "(this GPU)"]
        write_log(tmp_path, name, {"section": "8b", "tool": "fit", "model": "llama3-8b",
                                   "variant": variant, "strategy": "fsdp", "gpus": 2, "fp8": fp8},
                  lines)

    llama("t1", "torch-compile-ac-mlp", 1200.0, 5.0, False)
    llama("t2", "fp8-delayed-te-attn-ac-mlp", 800.0, 5.05, True)
    write_log(tmp_path, "t3", {"section": "8b", "tool": "plain", "variant": "torch-compile-ac-mlp",
                               "strategy": "fsdp", "gpus": 2, "fp8": False},
              [json.dumps({"script": "plain_pytorch", "gpus": 2, "ms_per_step": 1000.0,
                           "tok_s_per_gpu": 8192, "mfu_pct": 48.0, "peak_mem_gib": 61.0})])
    for name, losses in (("whole", [4.0] * 40), ("again", [4.0] * 30 + [4.4] * 10),
                         ("resumed", [None] * 30 + [4.2] * 9 + [4.0])):
        lines = [line for step, loss in enumerate(losses, 1) if loss is not None
                 for line in [re.sub(r"loss \S+", f"loss {loss:.4f}",
                                     monitor_lines({step: 700.0})[0])]]
        lines += ["FP8 scaling state restored for 8 TE modules"] * (name == "resumed")
        write_log(tmp_path, f"r8-{name}", {"section": "resume8b", "tool": "fit", "role": name,
                                           "variant": "fp8-delayed-te-attn-ac-mlp", "gpus": 2,
                                           "fp8": True}, lines)
    text = summary.summarize(tmp_path)
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.startswith("  ") and line.split()[0] in (
                "torch-compile-ac-mlp", "fp8-delayed-te-attn-ac-mlp", "plain:torch-compile-ac-mlp")}
    assert rows["plain:torch-compile-ac-mlp"][2:5] == ["1.000", "8,192", "1.00x"]
    assert rows["torch-compile-ac-mlp"][4] == "0.83x"
    assert rows["fp8-delayed-te-attn-ac-mlp"][4] == "1.25x"  # over the plain script's
    assert rows["fp8-delayed-te-attn-ac-mlp"][-1] == "+1.00%"  # against the package's BF16
    assert ("resume from the sharded step-30 checkpoint: 10 steps compared (31..40); relative "
            "loss gap at the first 5.00e-02, worst 5.00e-02, mean 4.50e-02") in text
    assert "two uninterrupted runs over the same steps: relative gap worst 1.00e-01, mean " \
        "1.00e-01 (the run-to-run spread)" in text
    assert "FP8 scaling state restored for 8 TE modules" in text


def test_the_loss_check_and_bench_tables(tmp_path):
    """loss-gpt2's logs: each run's val loss at the one-GPU run's last validation against it;
    bench.json's rows and doctor's prediction against bench's measured speedup."""
    for name, strategy, val in (("loss-1gpu", "single", 3.4), ("loss-ddp-2gpu", "ddp", 3.434)):
        write_log(tmp_path, name, {"section": "loss", "tool": "fit", "variant": "x",
                                   "strategy": strategy, "gpus": 1},
                  monitor_lines({200: 30.0}) + [f"step 200 | val/loss {val:.4f} | val/ppl 30.00"])
    (tmp_path / "bench-gpt2").mkdir()
    result = {"status": "ran", "mfu": 0.4, "peak_mem_gib": 5.0, "tokens_per_s": 500000.0}
    (tmp_path / "bench-gpt2" / "bench.json").write_text(json.dumps({
        "setup": {"model": "gpt2", "n_layer": 12, "batch_size": 16, "seq_len": 1024},
        "env": {"device": "GPU", "git_commit": "abc"}, "baseline": "torch-compile",
        "results": [{**result, "variant": "te-bf16", "ms_per_step": 40.0, "speedup": 1.0},
                    {**result, "variant": "fp8-delayed", "ms_per_step": 32.0, "speedup": 1.25},
                    {"variant": "fp8-mxfp8", "status": "skipped", "reason": "needs Blackwell"}]}))
    (tmp_path / "doctor-gpt2.json").write_text(json.dumps({"probe": {"speedup": {
        "delayed": 1.20, "block": 1.1}}}))
    text = summary.summarize(tmp_path)
    assert re.search(r"loss-ddp-2gpu +3\.4340  vs 1 GPU \+1\.00%", text), text
    assert re.search(r"fp8-delayed +500,000 tok/s +32\.00 ms MFU +40\.0% +5\.00 GiB +1\.25x", text)
    assert "fp8-mxfp8                       skipped: needs Blackwell" in text
    assert "gpt2        delayed   predicted 1.20x  measured 1.25x  error -4%" in text
    assert "gpt2        block     predicted 1.10x  (no bench measurement)" in text
