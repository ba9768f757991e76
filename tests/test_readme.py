"""Every command in README.md and the user guides (docs/*.md but the results and the
architecture) is exercised: by a test named in ``COVERAGE``, by CI itself, or on the GPU machine;
every link between them resolves. Commands run here: every ``fit`` command parses, every other command's flags
exist, the migration table's overrides parse to what they say, the CPU FP8-vs-BF16 comparison and
the doctor run as written."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
import torch

from fp8_lightning.cli import EXTRA_COMMANDS
from fp8_lightning.te_availability import fallback_precision, te_status
from tests._runs import run_main, run_main_logged

ROOT = Path(__file__).resolve().parents[1]
# The README and the user guides it links, read as one text
NOT_GUIDES = {"benchmarks.md", "convergence.md", "architecture.md"}
USER_DOCS = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").glob("*.md"))
                                   if p.name not in NOT_GUIDES)]
README = "\n".join(p.read_text() for p in USER_DOCS)
CI = "ci"  # run by .ci/run (install + the whole suite)
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
GPU = "gpu"  # run by hand on the GPU machine (the lead's device runs)
NO_CLUSTER = "not run: needs a SLURM cluster"  # the README says so beside the command

# README command (comments dropped, continuation lines joined, `&&` chains split, quotes removed)
# -> where it is exercised: test node ids (checked below by collecting them), CI, or the GPU machine.
COVERAGE: dict[str, tuple[str, ...]] = {
    "python3 -m venv .venv": (CI,),
    ". .venv/bin/activate": (CI,),
    "pip install -e .": (CI,),  # CI installs the same package with the dev extras
    "pip install -e .[dev]": (CI,),
    "python -m pytest -q -n auto --dist loadfile": (CI,),
    "pip install -e .[te]": (GPU,),
    "python -m pytest -m gpu": (GPU,),
    "python -m fp8_lightning fit --config configs/quickstart.yaml": (
        "tests/test_cli.py::test_quickstart_fit_writes_checkpoint_and_tensorboard",
        "tests/test_cli.py::test_quickstart_loss_falls"),
    "python examples/own_model.py --steps 20 --recipe delayed": (
        "tests/fp8/test_any_model.py::test_the_example_trains_under_the_plugin_and_says_what_ran",
        "tests/test_gpu_any_model.py::test_the_example_trains_fp8_under_the_plugin"),
    "python -m fp8_lightning doctor": ("tests/commands/test_doctor.py::test_no_config_reports_the_environment",),
    "tensorboard --logdir runs/quickstart": (  # a viewer: what it shows is checked
        "tests/test_cli.py::test_quickstart_fit_writes_checkpoint_and_tensorboard",
        "tests/callbacks/test_monitor.py::test_tensorboard_scalars_after_a_short_fit"),
    "python -m fp8_lightning checkpoints runs/quickstart": (
        "tests/commands/test_checkpoints.py::test_checkpoints_command_lists_step_tokens_loss_precision_size",),
    "python -m fp8_lightning generate --ckpt runs/quickstart/checkpoints/last.ckpt --prompt ROMEO: "
    "--max_new_tokens 100 --temperature 0.8 --top_k 200": (
        "tests/commands/test_generate.py::test_generate_command", "tests/commands/test_generate.py::test_generate_python_api"),
    "python -m fp8_lightning fit --config configs/quickstart.yaml --ckpt_path last": (
        "tests/callbacks/test_checkpoint.py::test_resume_after_sigkill_sees_exactly_the_same_batches_and_losses",),
    "python -m pytest -q tests/test_notebook.py": (
        "tests/test_notebook.py::test_committed_notebook_has_no_outputs",
        "tests/test_notebook.py::test_fp8_formats_are_computed_live",
        "tests/test_notebook.py::test_training_states_what_ran_and_the_loss_is_finite",
        "tests/test_notebook.py::test_doctor_explains_fp8_needs_a_gpu",
        "tests/test_notebook.py::test_notebook_on_an_fp8_gpu_trains_fp8_and_shows_scaling"),
    "python -m fp8_lightning fit --config configs/gpt2_fp8.yaml --trainer.plugins.init_args.recipe "
    "tensorwise --model.attention sdpa": (GPU, "tests/test_readme.py::test_fit_commands_run_a_step",
                                          "tests/test_gpu_engines.py::test_torchao_recipe_trains_100_steps_close_to_bf16_compiled"),
    "python -m fp8_lightning fit --config configs/gpt2_fp8.yaml --trainer.plugins.init_args.engine "
    "auto --trainer.plugins.init_args.recipe null": (
        GPU, "tests/test_readme.py::test_fit_commands_run_a_step",
        "tests/test_gpu_engines.py::test_auto_measures_chooses_and_the_run_trains_what_it_chose"),
    "python -m fp8_lightning fit --config configs/gpt2_fp8.yaml --print_config": (
        "tests/test_readme.py::test_fit_commands_run_a_step", "tests/test_cli.py::test_print_config_and_dotted_overrides"),
    "python -m fp8_lightning fit --config configs/gpt2_fp8.yaml --model.config.name gpt2-medium "
    "--trainer.max_steps 2000 --data.batch_size 8 --trainer.plugins.init_args.recipe current": (
        GPU, "tests/test_readme.py::test_fit_commands_run_a_step"),
    "python -m fp8_lightning fit --config configs/gpt2_fp8.yaml": (
        GPU, "tests/test_gpu_monitor.py::test_gpt2_fp8_run_shows_fp8_sane_mfu_and_fp8_stats"),
    "python -m fp8_lightning fit --config configs/gpt2_bf16.yaml": (GPU, "tests/test_readme.py::test_fit_commands_run_a_step"),
    "python -m fp8_lightning compare runs/gpt2_bf16 runs/gpt2_fp8 --output fp8_vs_bf16.png": (
        GPU, "tests/commands/test_compare.py::test_compare_command"),
    "python -m fp8_lightning fit --config configs/quickstart.yaml --trainer.default_root_dir runs/quick_fp8": (
        "tests/test_readme.py::test_quickstart_fp8_vs_bf16_comparison",),
    "python -m fp8_lightning fit --config configs/quickstart.yaml --trainer.default_root_dir runs/quick_bf16 "
    "--trainer.plugins null --trainer.precision bf16-mixed": (
        "tests/test_readme.py::test_quickstart_fp8_vs_bf16_comparison",),
    "python -m fp8_lightning compare runs/quick_bf16 runs/quick_fp8 --output quick_fp8_vs_bf16.png": (
        "tests/test_readme.py::test_quickstart_fp8_vs_bf16_comparison",),
    "python -m fp8_lightning fit --config configs/quickstart.yaml --trainer.callbacks+=fp8_lightning.FaultInjection "
    "--trainer.callbacks.steps [100,101,102]": (
        "tests/test_readme.py::test_fit_commands_run_a_step",
        "tests/callbacks/test_guard.py::test_incident_rolls_back_switches_to_bf16_then_reenables_fp8",
        "tests/callbacks/test_guard.py::test_plain_bf16_run_errors_without_fp8_switch",
        "tests/test_gpu_safety.py::test_real_fp8_divergence_falls_back_recovers_and_reenables_fp8"),
    "python -m fp8_lightning prepare --inputs corpus/*.jsonl --output_dir data/mycorpus --text_field text "
    "--seq_len 1024 --val_fraction 0.01": (
        "tests/test_console.py::test_prepare_prints_one_line_per_split_and_a_summary",
        "tests/data/test_prepare.py::test_prepare_jsonl_puts_eot_between_documents"),
    "python -m fp8_lightning fit --config configs/gpt2_fp8.yaml --data.data_dir data/mycorpus": (
        GPU, "tests/test_readme.py::test_fit_commands_run_a_step"),  # as scripts/convergence.sh runs it
    # Hugging Face weights in and out: tiny GPT-2 and Llama directories built by transformers.
    "python -m fp8_lightning fit --config configs/gpt2_fp8.yaml --model.init_from hf/gpt2 "
    "--data.data_dir data/mycorpus": (
        "tests/test_readme.py::test_fit_commands_run_a_step",  # parses
        "tests/test_hf.py::test_readme_fine_tune_config_has_hugging_face_gpt2s_shape",
        "tests/test_hf.py::test_fine_tune_from_hf_under_the_fp8_plugin",
        "tests/test_hf.py::test_init_from_with_a_different_config_names_every_field",
        "tests/test_hf.py::test_init_from_with_another_tokenizer_than_the_data_is_one_error_line",
        "tests/test_hf.py::test_init_from_of_another_shape_than_the_config_is_one_error_line",
        "tests/test_gpu_hf.py::test_converted_gpt2_fine_tunes_under_fp8_and_converts_back", GPU),
    "python -m fp8_lightning convert --to-hf runs/gpt2_fp8/checkpoints/last.ckpt hf/gpt2-mine": (
        "tests/test_readme.py::test_other_commands_take_their_flags",
        "tests/commands/test_convert.py::test_round_trip_in_then_out_is_identical_and_loads_in_transformers",
        "tests/commands/test_convert.py::test_bad_input_is_one_error_line_naming_the_file_and_field"),
    "python -m fp8_lightning convert --from-hf hf/gpt2 gpt2.ckpt": (
        "tests/test_readme.py::test_other_commands_take_their_flags",
        "tests/test_hf.py::test_weights_in_give_transformers_logits",
        "tests/commands/test_convert.py::test_round_trip_in_then_out_is_identical_and_loads_in_transformers",
        "tests/commands/test_convert.py::test_converted_checkpoint_generates_and_records_its_tokenizer",
        "tests/commands/test_convert.py::test_bad_input_is_one_error_line_naming_the_file_and_field"),
    "python -m fp8_lightning bench --config configs/gpt2_fp8.yaml": (
        GPU, "tests/test_gpu_bench.py::test_bench_runs_every_variant_or_says_why",
        "tests/commands/test_bench.py::test_bench_cli_prints_table_and_writes_json_and_png"),
    "python -m fp8_lightning bench --config configs/gpt2_fp8.yaml --model gpt-1.3b --batch_size 8 "
    "--variants torch-compile,te-bf16,fp8-delayed,fp8-current --steps 20": (
        GPU, "tests/test_gpu_bench.py::test_bench_cli_on_gpu"),
    "python -m fp8_lightning doctor --config configs/gpt2_fp8.yaml": (
        "tests/test_readme.py::test_doctor_command_on_cpu",
        "tests/test_gpu_bench.py::test_doctor_probe_predicts_and_compares_with_bench"),
    "python -m fp8_lightning fit --config configs/gpt2_fp8.yaml --trainer.callbacks+=fp8_lightning.FP8Stats "
    "--trainer.callbacks.every_n_steps 100": (
        "tests/test_readme.py::test_fit_commands_run_a_step",
        "tests/test_gpu_monitor.py::test_gpt2_fp8_run_shows_fp8_sane_mfu_and_fp8_stats"),
    # Several GPUs: the same strategies on CPU processes (gloo) here; on two GPUs by
    # python -m benchmarks.harness (docs/benchmarks.md).
    "python -m fp8_lightning fit --config configs/gpt2_fp8.yaml --config configs/ddp.yaml":
        ("tests/test_distributed.py::test_ddp_checkpoint_counts_every_rank_and_resumes_in_step", GPU),
    "python -m fp8_lightning fit --config configs/gpt2_fp8.yaml --config configs/ddp.yaml "
    "--trainer.callbacks+=fp8_lightning.StepProfile --trainer.callbacks.start_step 50": (
        "tests/test_readme.py::test_fit_commands_run_a_step",
        "tests/test_gpu_ddp.py::test_fp8_on_two_gpus_takes_the_fast_path_and_trains_as_one_gpu"),
    "python -m fp8_lightning fit --config configs/gpt2_fp8.yaml --config configs/fsdp.yaml --trainer.devices 4":
        ("tests/test_fsdp2.py::test_fsdp_checkpoint_is_a_directory_of_shards_that_lists_and_resumes", GPU),
    "python -m fp8_lightning fit --config configs/gpt2_fp8.yaml --config configs/fsdp.yaml --trainer.devices 4 --ckpt_path last":
        ("tests/test_fsdp2.py::test_fsdp_checkpoint_is_a_directory_of_shards_that_lists_and_resumes", GPU),
    # Llama-3-8B on two GPUs: parsed and built on the meta device here; the memory levers on a GPU.
    "python -m fp8_lightning fit --config configs/llama3_8b_fp8.yaml --data.data_dir data/text":
        ("tests/test_readme.py::test_the_8b_configs_parse_and_build_the_full_model_on_the_meta_device",
         "tests/test_gpu_memory.py::test_a_run_too_large_for_the_gpu_stops_before_its_first_step"),
    "python -m fp8_lightning fit --config configs/llama3_8b_fp8.yaml --data.data_dir data/text --model.activation_checkpointing full":
        ("tests/test_readme.py::test_fit_commands_run_a_step",
         "tests/test_gpu_memory.py::test_activation_checkpointing_under_fp8_matches_and_keeps_less"),
    "python -m fp8_lightning consolidate runs/gpt2_fp8/checkpoints/last.ckpt runs/gpt2_fp8/gpt2-step5000.ckpt":
        ("tests/test_fsdp2.py::test_fsdp_checkpoint_consolidates_to_one_file_that_loads_and_resumes_on_one_process", GPU),
    "torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint head-node:29500 -m fp8_lightning fit --config configs/gpt2_fp8.yaml --config configs/fsdp.yaml --trainer.num_nodes 2 --trainer.devices 8":
        # two nodes of one CPU process on this host; HSDP (a replica per node) in two nodes of two
        ("tests/test_distributed.py::test_a_two_node_torchrun_launch_is_picked_up_by_lightning",
         "tests/test_hsdp.py::test_hsdp_splits_the_data_over_every_rank_of_both_nodes"),
    # a user's Hugging Face Llama under FSDP2Strategy: two CPU ranks (gloo) here; FP8 on two GPUs
    "python examples/hf_llama.py --devices 4 --strategy fsdp --preset llama3-8b --steps 20 "
    "--ckpt runs/llama/last.ckpt --export runs/llama/hf": (
        "tests/test_hf_fsdp2.py::test_the_examples_presets_are_llama_shapes_and_its_command_line_is_checked",
        "tests/test_hf_fsdp2.py::test_the_llamas_decoder_layers_are_the_fsdp2_units",
        "tests/test_hf_fsdp2.py::test_a_sharded_checkpoint_resumes_where_the_run_left_off",
        "tests/test_hf_fsdp2.py::test_the_export_loads_in_transformers_with_the_checkpoints_weights",
        "tests/test_gpu_ddp.py::test_a_users_hugging_face_llama_trains_fp8_under_fsdp2_resumes_and_exports",
        GPU),
    "sbatch examples/slurm_fit.sbatch data/text-8k": (
        NO_CLUSTER, "tests/test_slurm_example.py::test_each_task_s_slurm_environment_gives_its_ranks_of_the_run"),
}


def readme_commands(text: str = README) -> list[str]:
    """The commands of the ```bash blocks, in order, each once."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            part: list[str] = []
            for token in shlex.split(line, comments=True) + ["&&"]:
                if token != "&&":
                    part.append(token)
                elif part:
                    commands.append(" ".join(part))
                    part = []
    return list(dict.fromkeys(commands))


def fp8_lightning_commands(subcommand: str) -> list[list[str]]:
    """The arguments of each README ``python -m fp8_lightning SUBCOMMAND ...``."""
    prefix = ["python", "-m", "fp8_lightning", subcommand]
    return [shlex.split(c)[4:] for c in readme_commands() if shlex.split(c)[:4] == prefix]




@pytest.fixture
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the README's paths are relative to the repository root


def test_every_readme_command_is_covered():
    commands = readme_commands()
    assert len(commands) > 20
    missing = [c for c in commands if c not in COVERAGE]
    stale = [c for c in COVERAGE if c not in commands]
    assert not missing, "README commands without a test (add them to COVERAGE):\n" + "\n".join(missing)
    assert not stale, "COVERAGE lists commands the README no longer has:\n" + "\n".join(stale)


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in path.read_text().splitlines() if line.startswith("#")}


def test_links_between_the_docs_resolve():
    """Each relative link of the README and docs/ names a file that exists and, with a
    ``#anchor``, a heading of that file."""
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = doc.parent / path if path else doc
            if not file.exists() or (anchor and file.suffix == ".md"
                                     and anchor not in heading_anchors(file)):
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert len(USER_DOCS) > 5 and not broken, broken


def test_the_readme_is_a_short_guide():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_the_user_docs_hold_results_not_history():
    """No commit hashes or work-session numbers in the README and any doc (the guides, the results
    and the architecture): history is git's."""
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        assert not re.findall(r"`[0-9a-f]{7,40}`", text), doc.name
        assert not re.findall(r"\b[Ss]essions? \d+", text), doc.name


def test_coverage_names_tests_that_exist(request):
    """Each test COVERAGE names is one pytest collects: this run's own collection when it holds
    them all (a run of the whole suite), else pytest's collection of their files."""
    nodes = {n for where in COVERAGE.values() for n in where if n not in (CI, GPU, NO_CLUSTER)}
    collected = {item.nodeid.split("[")[0] for item in request.session.items}
    if nodes - collected:  # some files only, or a name that is no test: pytest's own answer
        files = sorted({n.split("::")[0] for n in nodes})
        result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                                 "no:cacheprovider", *files],
                                cwd=ROOT, env=ENV, text=True, capture_output=True, timeout=300)
        collected = {line.split("[")[0] for line in result.stdout.splitlines() if "::" in line}
        assert collected, result.stdout[-2000:] + result.stderr[-2000:]
    assert sorted(nodes - collected) == []


def test_ci_commands_are_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    for command, where in COVERAGE.items():
        if CI in where and command != "pip install -e .":  # the plain install: CI adds [dev]
            assert command in " ".join(shlex.split(ci, comments=True)), command


# Run as one tiny step (a 2-block model, 2 sequences, one validation batch): the command line
# and every class it names really instantiate and train, not only parse.
TINY_STEP = ["--model.config.name", "tiny", "--trainer.max_steps", "1", "--trainer.val_check_interval", "1",
             "--trainer.limit_val_batches", "1", "--data.batch_size", "2", "--data.num_workers", "0"]


def parse_only(argv: list[str]) -> str:
    """Why a README `fit` command is only parsed here ("" when it runs a step)."""
    if "--ckpt_path" in argv:
        return "resumes: tests/callbacks/test_checkpoint.py runs the resume"
    if "--model.init_from" in argv:
        return "needs a Hugging Face model directory: tests/test_hf.py fine-tunes tiny ones"
    if any(a in ("configs/ddp.yaml", "configs/fsdp.yaml") for a in argv):
        return "several processes: tests/test_distributed.py and test_fsdp2.py run DDP/FSDP2 on the CPU"
    if "--data.data_dir" in argv:
        return "needs the user's prepared corpus"
    return ""


@pytest.mark.parametrize("argv", fp8_lightning_commands("fit"), ids=" ".join)
def test_fit_commands_run_a_step(argv, capsys, at_root, tmp_path):
    """Every README `fit` command instantiates everything it names and trains one tiny step
    (those that resume, need several processes or the user's data: parses)."""
    if "--print_config" in argv or parse_only(argv):
        code, out, err = run_main(capsys, ["fit", *argv, *([] if "--print_config" in argv else ["--print_config"])])
        assert code == 0, err[-3000:]
        assert out.startswith("# lightning.pytorch==") and "model:" in out
        return
    code, out, err = run_main(capsys, ["fit", *argv, *TINY_STEP, "--trainer.default_root_dir", str(tmp_path)])
    assert code == 0, err[-3000:]
    (last,) = tmp_path.rglob("last.ckpt")
    assert torch.load(last, weights_only=True)["global_step"] == 1


@pytest.mark.parametrize("argv", [[sub, *argv] for sub in EXTRA_COMMANDS
                                  for argv in fp8_lightning_commands(sub)], ids=" ".join)
def test_other_commands_take_their_flags(argv, capsys):
    """Each flag a README `prepare/checkpoints/generate/compare/convert/bench/doctor` command
    uses exists."""
    code, out, err = run_main(capsys, [argv[0], "--help"])
    assert code == 0, err
    for flag in (a for a in argv[1:] if a.startswith("--")):
        if argv[0] == "convert":  # `--from-hf`/`--to-hf` are the CLI's spellings of `--from_hf`
            flag = {"--from-hf": "--from_hf", "--to-hf": "--to_hf"}.get(flag, flag)
        assert re.search(rf"{re.escape(flag)}\b", out), f"{argv[0]} --help has no {flag}"


def migration_overrides() -> list[str]:
    """The backticked ``--...`` overrides in the right column of the migration table."""
    section = README.split("## Coming from a hand-written `train_fp8.py`", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `--")]
    assert len(rows) == 11, rows
    cells = [re.split(r"(?<!\\)\|", row)[2] for row in rows]
    return list(dict.fromkeys(o for cell in cells for o in re.findall(r"`(--[^`]+)`", cell)))


@pytest.mark.parametrize("override", migration_overrides())
def test_migration_table_overrides_parse(override, capsys, at_root):
    """Each override in the migration table parses and sets what it names (`interval` must be
    refused: removed in TransformerEngine 2.x)."""
    args = shlex.split(override)
    if args[-1].endswith(".interval"):
        code, _, err = run_main(capsys, ["fit", "--config", "configs/gpt2_fp8.yaml", *args, "1",
                                         "--print_config"])
        assert code == 2 and "'interval' is not an option of FP8Precision" in err
        return
    code, out, err = run_main(capsys, ["fit", "--config", "configs/gpt2_fp8.yaml", *args,
                                       "--print_config"])
    assert code == 0, err[-3000:]
    for key, value in zip(args[::2], args[1::2]):
        field = key.lstrip("-").split(".")[-1]
        # a mapping (the recipe with its fields) prints one line per field
        mapping = yaml.safe_load(value) if value.startswith("{") else {field: value}
        for field, value in mapping.items():
            value = str(value).lower() if isinstance(value, bool) else str(value)
            # (jsonargparse prints an int given to an int-or-float field as a float: 20 -> 20.0)
            assert re.search(rf"^\s*{re.escape(field)}: {re.escape(value)}(\.0)?$", out, re.M), \
                (key, field, value)


# Every full config (ddp.yaml and fsdp.yaml are strategy overlays added to one of these).
FULL_CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml")
                      if "callbacks:" in p.read_text())


@pytest.mark.parametrize("config", FULL_CONFIGS)
def test_checkpoint_is_the_last_callback_of_every_config(config, capsys, at_root):
    """The README: `--trainer.callbacks.init_args.<field>` reaches the Checkpoint callback."""
    code, out, err = run_main(capsys, ["fit", "--config", f"configs/{config}",
                                       "--trainer.callbacks.init_args.every_n_train_steps", "123",
                                       "--print_config"])
    assert code == 0, err[-3000:]
    assert "every_n_train_steps: 123" in out


@pytest.mark.parametrize("config", ["llama3_8b_fp8.yaml", "llama3_8b_bf16.yaml"])
def test_the_8b_configs_parse_and_build_the_full_model_on_the_meta_device(config, capsys, at_root):
    """Llama-3-8B at full depth on two GPUs with FSDP2: the config as written, built without
    memory (the meta device), and its memory estimate, with the config's activation
    checkpointing, fits two 80 GB H100s (77.4 GiB free on each)."""
    import yaml

    from fp8_lightning.config import GPTConfig
    from fp8_lightning.memory import GIB, RunShape, estimate_memory
    from fp8_lightning.module import GPTLightningModule

    code, out, err = run_main(capsys, ["fit", "--config", f"configs/{config}", "--print_config"])
    assert code == 0, err[-3000:]
    printed = yaml.safe_load(out)
    trainer, model, data = printed["trainer"], printed["model"], printed["data"]
    assert trainer["devices"] == 2 and trainer["strategy"]["class_path"].endswith("FSDP2Strategy")
    assert trainer["val_check_interval"] and trainer["limit_val_batches"]  # evaluation on
    assert model["compile"] is True
    module = GPTLightningModule(config=GPTConfig(**model["config"]), backend="torch",
                                activation_checkpointing=model["activation_checkpointing"])
    with torch.device("meta"):
        module.configure_model()
    config_8b = module.config
    assert (config_8b.n_layer, config_8b.n_embd, config_8b.ffn_hidden, config_8b.n_head,
            config_8b.n_kv_heads) == (32, 4096, 14336, 32, 8)
    assert 8.0e9 < sum(p.numel() for p in module.model.parameters()) < 8.1e9
    assert config_8b.block_size == 8192  # data.seq_len follows it
    run = RunShape(data["batch_size"], config_8b.block_size, shards=2, fp8="fp8" in config,
                   fp32_residual="bf16" in config,
                   activation_checkpointing=model["activation_checkpointing"])
    assert estimate_memory(config_8b, run).total < 77 * GIB


def test_quickstart_fp8_vs_bf16_comparison(tmp_path, capsys):
    """The README's CPU comparison, as written, shortened to 3 small steps."""
    quick = [a for a in fp8_lightning_commands("fit") if any(x.startswith("runs/quick_") for x in a)]
    (compare,) = [a for a in fp8_lightning_commands("compare") if "runs/quick_bf16" in a]
    assert len(quick) == 2
    short = ["--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--data.batch_size", "2",
             "--trainer.limit_val_batches", "2", "--trainer.log_every_n_steps", "1"]

    def in_tmp(argv):
        return [a.replace("runs/", f"{tmp_path}/runs/", 1) if a.startswith("runs/") else a for a in argv]

    def fit(argv):  # in this process: the commands are under test, not Python's start-up
        code, log = run_main_logged(capsys, ["fit", *in_tmp(argv), *short])
        assert code == 0, log[-3000:]
        return log

    fp8, bf16 = (fit(argv) for argv in quick)
    code, table, err = run_main(capsys, ["compare", *in_tmp(compare[:-1]), str(tmp_path / compare[-1])])
    assert code == 0, err
    assert (tmp_path / "quick_fp8_vs_bf16.png").is_file()
    assert "precision: bf16-mixed" in bf16
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")] for line in table.splitlines()
            if line.startswith(str(tmp_path))}
    fp8_row, bf16_row = rows[f"{tmp_path}/runs/quick_fp8"], rows[f"{tmp_path}/runs/quick_bf16"]
    assert bf16_row[1] == "bf16-mixed"
    if te_status()[0]:
        assert "precision: FP8 delayed" in fp8 and fp8_row[1].startswith("FP8")
    else:  # the fallback: the fastest precision this machine has, said in the table
        assert "FP8 is not available:" in fp8
        if fallback_precision()[0] == "bf16-mixed":  # the BF16 computation itself: same losses
            assert fp8_row[1] == "BF16 (fallback)" and fp8_row[2:5] == bf16_row[2:5]
        else:  # a CPU without BF16 instructions trains FP32
            assert fp8_row[1] == "FP32 (fallback)"


def test_doctor_command_on_cpu(capsys, at_root):
    if te_status()[0]:
        pytest.skip("an FP8 machine: tests/test_gpu_bench.py runs the probe")
    (argv,) = [a for a in fp8_lightning_commands("doctor") if a]  # the one with --config
    code, out, _ = run_main(capsys, ["doctor", *argv])
    assert code == 1  # FP8 requested but unusable here
    assert "FP8 delayed is requested but CANNOT run here" in out
    assert "FP8 needs an NVIDIA GPU with compute capability >= 8.9" in out


# The console lines a quickstart fit prints (fp8_lightning.callbacks.monitor and cli.after_fit)
QUICKSTART_LINES = {
    "precision": r"precision: (FP8 \w+|BF16|FP32) ?(\(fallback: .+\))?",
    "step": r"step (\d+) \| loss ([\d.]+) \| lr ([\d.e+-]+) \| norm [\d.]+ \| dt [\d.]+ms \| "
            r"tok/s [\d,]+ \| mfu (n/a|[\d.]+%)( \| mfu_fp8 [\d.]+%)? \| (.+)",
    "val": r"step (\d+) \| val/loss ([\d.]+) \| val/ppl [\d.]+",
    "sample": r"sample \(step (\d+)\): ['\"]ROMEO:.*['\"]",
    "done": r"done: step (\d+), ([\d,]+) tokens seen; this run took [\d.]+ (s|min); "
            r"train loss ([\d.]+), val loss ([\d.]+)",
    "checkpoints": r"checkpoints: \S+/checkpoints",
    "generate": r"sample: python -m fp8_lightning generate --ckpt \S+/checkpoints/last\.ckpt "
                r"--prompt \"\.\.\.\"",
    "continue": r"continue: the same command with --ckpt_path last --trainer\.max_steps (\d+) "
                r"--model\.lr_decay_steps (\d+)",
}


def readme_quickstart_output() -> list[str]:
    """The console output the README shows for the quickstart (its section's block with `done:`)."""
    section = (ROOT / "README.md").read_text().split("## The quickstart run", 1)[1].split("\n## ")[0]
    (block,) = [b for b in re.findall(r"```\n(.*?)```", section, re.S) if "\ndone: step" in b]
    return block.strip().splitlines()


def kind_of(line: str) -> tuple[str, re.Match]:
    for kind, pattern in QUICKSTART_LINES.items():
        if match := re.fullmatch(pattern, line):
            return kind, match
    raise AssertionError(f"the README shows a line no quickstart prints: {line!r}")


def test_the_readmes_quickstart_output_is_what_the_quickstart_prints(tmp_path, capsys, at_root):
    """The README's quickstart output cannot go stale: every line has the shape of a line the
    run prints, and what a short run can reproduce agrees with it: its first logged step (loss,
    learning rate, precision), the tokens of 300 steps, the continue line's numbers, and the
    validation loss the README's prose quotes."""
    import yaml

    shown = [kind_of(line) for line in readme_quickstart_output()]
    kinds = [k for k, _ in shown]
    assert kinds[0] == "precision" and kinds[-4:] == ["done", "checkpoints", "generate", "continue"]
    config = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())
    max_steps, batch = config["trainer"]["max_steps"], config["data"]["batch_size"]
    done = dict(shown)["done"]
    assert int(done[1]) == max_steps
    assert int(done[2].replace(",", "")) == max_steps * batch * 128  # the tiny preset's context
    assert dict(shown)["continue"].groups() == (str(2 * max_steps), str(max_steps))
    vals = [m for k, m in shown if k == "val"]
    assert vals and vals[-1][2] == done[5]  # the last validation is the one the run ends on
    prose = re.search(r"reached a validation\s+loss of ([\d.]+)", (ROOT / "README.md").read_text())
    assert prose and float(prose[1]) == round(float(done[5]), 2), (prose, done[5])

    # The run's first logged step, as a user's quickstart makes it (10 steps of the same run).
    code, out, err = run_main(capsys, [
        "fit", "--config", "configs/quickstart.yaml", "--trainer.max_steps", "10",
        "--model.lr_decay_steps", str(max_steps), "--trainer.limit_val_batches", "0",
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path)])
    assert code == 0, err[-3000:]
    ran = [kind_of(line) for line in out.splitlines() if re.fullmatch(QUICKSTART_LINES["step"], line)]
    ran_step = next(m for k, m in ran if k == "step" and m[1] == "10")
    shown_step = next(m for k, m in shown if k == "step" and m[1] == "10")
    assert ran_step[3] == shown_step[3]  # the learning rate: the schedule, exactly
    # the loss: the same seed and data; BF16 or FP32, whichever this CPU has, moves it a little
    assert abs(float(ran_step[2]) - float(shown_step[2])) < 0.02 * float(shown_step[2]), (
        ran_step[0], shown_step[0])
    assert re.fullmatch(r"(BF16|FP32) \(fallback\)|FP8 \w+", ran_step[6]) and \
        re.fullmatch(r"(BF16|FP32) \(fallback\)|FP8 \w+", shown_step[6])


# Files the maps name that are the user's or a run's, not the repository's
USERS_FILES = {"config.yaml", "train_fp8.py"}


@pytest.mark.parametrize("doc", ["README.md", "docs/architecture.md"])
def test_the_maps_name_only_files_that_exist(doc):
    """README's layout and the architecture page name files by path or by bare name (inside a
    folder's list): each must be a file of the repository, so a rename cannot leave them stale."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, text=True, capture_output=True)
    files = set(tracked.stdout.split()) if tracked.returncode == 0 else {
        str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()}
    names = {Path(f).name for f in files}
    text = (ROOT / doc).read_text()
    missing = []
    for named in sorted(set(re.findall(r"`([\w./-]+\.(?:py|sh|yaml|md|ipynb|png))`", text))):
        if named in USERS_FILES:
            continue
        if "/" in named:
            found = any(f == named or f.endswith("/" + named) for f in files)
        else:
            found = named in names
        if not found:
            missing.append(named)
    assert not missing, f"{doc} names files that do not exist: {missing}"
