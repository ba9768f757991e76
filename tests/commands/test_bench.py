"""``bench`` on CPU: the torch variants really run on the tiny quickstart model."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fp8_lightning.commands.bench import bench
from fp8_lightning.commands.run_config import fp8_plugin_args, load_run_config
from fp8_lightning.config import ConfigError
from fp8_lightning.fp8 import FP8Precision
from fp8_lightning.measure import parse_variant

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


@pytest.fixture(scope="module")
def cli_bench(tmp_path_factory):
    """One CLI run: the eager torch variant plus TE/FP8 variants that cannot run on CPU.

    torch-compile is left to the GPU test: a cold inductor compile costs 30-60 s on a 2-core CPU.
    """
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "fp8_lightning", "bench", "--config", QUICKSTART,
         "--variants", "torch-eager,te-bf16,fp8-delayed,fp8-delayed-bf16ends-te-attn",
         "--steps", "3", "--warmup", "2", "--batch_size", "2", "--seq_len", "64",
         "--output_dir", str(out)],
        cwd=ROOT, env=env, text=True, capture_output=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


def test_bench_cli_prints_table_and_writes_json_and_png(cli_bench):
    out, result = cli_bench
    report = json.loads((out / "bench.json").read_text())
    assert report["baseline"] == "torch-eager"
    assert report["env"]["device"].startswith("CPU") and report["env"]["torch"]
    assert report["setup"]["batch_size"] == 2 and report["setup"]["seq_len"] == 64
    ran = {r["variant"]: r for r in report["results"] if r["status"] == "ran"}
    assert set(ran) == {"torch-eager"}
    for r in ran.values():
        for key in ("tokens_per_s", "ms_per_step", "tflops", "speedup", "loss"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["tokens_per_s"] == pytest.approx(2 * 64 / (r["ms_per_step"] / 1e3))
        assert r["mfu"] is None and r["peak_mem_gib"] is None  # no GPU peak / CUDA memory on CPU
    assert ran["torch-eager"]["speedup"] == 1.0
    skipped = {r["variant"]: r["reason"] for r in report["results"] if r["status"] == "skipped"}
    assert set(skipped) == {"te-bf16", "fp8-delayed", "fp8-delayed-bf16ends-te-attn"}
    assert all("TransformerEngine" in why for why in skipped.values())
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = result.stdout
    for text in ("tok/s", "ms/step", "TFLOP/s", "MFU", "peak GiB", "speedup", "torch-eager", "not run:", "fp8-delayed: skipped: TransformerEngine",
                 "data loading and Trainer hooks excluded", "host ms"):
        assert text in table, text
    # On a CPU it says what it really timed, and what it cannot know is n/a, not a number.
    assert "timing: wall clock (time.perf_counter) on the CPU" in table
    assert "CUDA events" not in table and "fused" not in table
    assert report["method"] in table and "CUDA events" not in report["method"]
    (row,) = [line for line in table.splitlines() if line.startswith("torch-eager ")]
    tflops, mfu, peak = row.split()[-4:-1]
    assert (mfu, peak) == ("n/a", "n/a")
    assert tflops != "0.00" and float(tflops) == pytest.approx(ran["torch-eager"]["tflops"], rel=0.05)


def test_fp8_variants_take_the_config_policy_and_own_recipe_fields(tmp_path):
    shipped = (ROOT / "configs" / "gpt2_fp8.yaml").read_text()
    assert "amax_history_len: 1\n          amax_compute_algo: most_recent" in shipped
    config = tmp_path / "gpt2_fp8.yaml"  # the headline config with a 1,024-step history instead
    config.write_text(shipped.replace("amax_history_len: 1\n          amax_compute_algo: most_recent",
                                      "amax_history_len: 1024"))
    run = load_run_config(str(config))
    delayed = fp8_plugin_args(run, parse_variant("fp8-delayed-bf16ends"))
    assert delayed["recipe"] == {"name": "delayed", "amax_history_len": 1024}
    assert delayed["fp8_lm_head"] is False
    assert delayed["bf16_first_layers"] == delayed["bf16_last_layers"] == 1
    block = fp8_plugin_args(run, parse_variant("fp8-block"))
    assert block["recipe"] == {"name": "block"}  # block's own defaults
    assert block["on_unavailable"] == "error" and block["weights"] == "bf16-mixed"
    fp8_attn = fp8_plugin_args(run, parse_variant("fp8-current-fp8-attn-fp8-head"))
    assert fp8_attn["recipe"] == {"name": "current", "fp8_dpa": True}
    assert fp8_attn["fp8_lm_head"] is True
    assert FP8Precision(**fp8_attn).recipe_config["fp8_dpa"] is True
    assert "fp8_layers" not in block  # unset in the config: the recipe's default
    assert fp8_plugin_args(run, parse_variant("fp8-tensorwise-autolayers"))["fp8_layers"] == "auto"
    assert fp8_plugin_args(run, parse_variant("fp8-tensorwise-alllayers"))["fp8_layers"] == "all"
    # -recent / -hist1024: the last step's amax / TE's 1,024-step history replace the config's
    shipped = load_run_config(str(ROOT / "configs" / "gpt2_fp8.yaml"))
    assert fp8_plugin_args(shipped, parse_variant("fp8-delayed-hist1024"))["recipe"] == {
        "name": "delayed", "amax_history_len": 1024, "amax_compute_algo": "max"}
    recent = fp8_plugin_args(run, parse_variant("fp8-delayed-recent"))["recipe"]
    assert recent == {"name": "delayed", "amax_history_len": 1, "amax_compute_algo": "most_recent"}
    assert FP8Precision(**fp8_plugin_args(run, parse_variant("fp8-delayed-recent"))).recipe_config[
        "amax_compute_algo"] == "most_recent"


def test_bench_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError) as err:
        bench(QUICKSTART, variants=["torch-eager", "nope", "te-bf16-bf16ends"], steps=0,
              output_dir=str(tmp_path))
    assert "'nope'" in str(err.value) and "te-bf16-bf16ends" in str(err.value)
    with pytest.raises(ConfigError, match="steps=0 must be a positive integer"):
        bench(QUICKSTART, variants="torch-eager", steps=0, output_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="baseline='te-bf16' is not among"):
        bench(QUICKSTART, variants="torch-eager", baseline="te-bf16", output_dir=str(tmp_path))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  config:\n    name: tiny\n    n_embed: 64\n")
    with pytest.raises(ConfigError, match="model.config.n_embed is not a GPTConfig field"):
        bench(str(bad), variants="torch-eager", output_dir=str(tmp_path))


def test_bench_cuts_layers_and_grows_block_size(tmp_path):
    report = bench(QUICKSTART, variants="torch-eager", steps=1, warmup=1, batch_size=1,
                   seq_len=160, n_layer=1, output_dir=str(tmp_path))
    setup = report["setup"]
    assert setup["n_layer"] == 1 and setup["model_config"]["block_size"] == 160
    assert report["results"][0]["status"] == "ran"


def test_a_long_variant_name_keeps_its_column(tmp_path):
    """The variant column widens to the longest name ran (a 26-character name ran into the
    precision column: ``fp8-tensorwise-autolayers-bf16resFP8 tensorwise``)."""
    from fp8_lightning.commands.bench import format_table

    name = "torch-eager-bf16res-ac-full"
    report = bench(QUICKSTART, variants=f"torch-eager,{name}", steps=1, warmup=1, batch_size=1,
                   seq_len=32, n_layer=1, output_dir=str(tmp_path))
    rows = [line.split() for line in format_table(report).splitlines()[2:4]]
    assert [row[0] for row in rows] == ["torch-eager", name] and rows[1][1] == "BF16"


def test_without_matplotlib_bench_prints_its_table_with_a_note(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    report = bench(QUICKSTART, variants="torch-eager", steps=1, warmup=1, batch_size=1,
                   seq_len=32, n_layer=1, output_dir=str(tmp_path))
    out = capsys.readouterr().out
    assert report["results"][0]["status"] == "ran" and "torch-eager" in out
    assert 'note: no plot: bench\'s plot (bench.png) needs matplotlib: pip install "fp8-lightning[plots]"' in out
    assert out.strip().splitlines()[-1] == f"wrote {tmp_path / 'bench.json'}"
    assert (tmp_path / "bench.json").exists() and not (tmp_path / "bench.png").exists()


def test_bench_writes_under_runs_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bench(QUICKSTART, variants="torch-eager", steps=1, warmup=1, batch_size=1, seq_len=32, n_layer=1)
    assert (tmp_path / "runs" / "bench" / "bench.json").exists()
    assert not (tmp_path / "bench_out").exists()


def test_bench_on_a_cpu_says_up_front_what_it_cannot_measure_and_shows_progress(
        tmp_path, caplog, monkeypatch):
    """On a CPU: one line first saying FP8 cannot run here and what will be timed (torch-compile
    left out of the defaults: compiling takes minutes there), then progress lines with the steps
    done and the time left while a variant runs."""
    import logging

    from fp8_lightning import progress

    monkeypatch.setattr(progress, "EVERY_S", 0.01)  # a line at every poll of a fast variant
    caplog.set_level(logging.INFO, logger="fp8_lightning")
    report = bench(QUICKSTART, steps=3, warmup=2, batch_size=1, seq_len=32, n_layer=1,
                   output_dir=str(tmp_path))
    lines = [r.getMessage() for r in caplog.records if r.name == "fp8_lightning.commands.bench"]
    assert lines[0].startswith("bench on a CPU: FP8 cannot run here, so nothing timed here tells "
                               "what FP8 buys on a GPU"), lines
    assert "1 variant(s) to time (torch-eager), each 2 warm-up + 3 timed steps" in lines[0]
    assert "torch-compile" not in [r["variant"] for r in report["results"]]
    assert [r["variant"] for r in report["results"] if r["status"] == "ran"] == ["torch-eager"]
    ticks = [line for line in lines if line.startswith("bench torch-eager, steps: ")]
    assert ticks, lines
    assert all(re.search(r"steps: (\d+ of 5 \(\d+%\)|5), \S+ so far", t) for t in ticks), ticks
