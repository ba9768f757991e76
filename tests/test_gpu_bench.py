"""GPU tests of ``bench`` and ``doctor`` (`pytest -m gpu -s` on the GPU machine).

They print their tables (run with ``-s``) and copy their JSON/PNG to ``$OUT`` when it is set.
"""

import gc
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8_lightning.commands.bench import bench
from fp8_lightning.measure import DEFAULT_VARIANTS
from fp8_lightning.commands.doctor import EXIT_OK, doctor
from fp8_lightning.fp8 import RECIPES, get_engine

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
GPT2_FP8 = str(ROOT / "configs" / "gpt2_fp8.yaml")
# GPT-2 124M cut to 4 blocks (so -bf16ends still leaves 2 FP8 blocks), 8 x 1024 tokens.
SMALL = dict(n_layer=4, batch_size=8, seq_len=1024)


def keep(path: Path, name: str) -> None:
    if os.environ.get("OUT"):
        shutil.copy(path, Path(os.environ["OUT"]) / name)


@pytest.fixture(scope="module")
def bench_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # Earlier test modules' garbage, freed during the first variant, would hide that variant's
    # peak (bench measures above what is allocated when it starts; a `bench` process has none).
    gc.collect()
    torch.cuda.empty_cache()
    report = bench(GPT2_FP8, steps=5, warmup=3, output_dir=str(out), **SMALL)
    keep(out / "bench.json", "test_gpu_bench.json")
    keep(out / "bench.png", "test_gpu_bench.png")
    return report


def test_bench_runs_every_variant_or_says_why(bench_report):
    results = {r["variant"]: r for r in bench_report["results"]}
    assert list(results) == DEFAULT_VARIANTS
    assert bench_report["baseline"] == "torch-compile"
    failed = {k: r["reason"] for k, r in results.items() if r["status"] == "failed"}
    assert not failed, failed
    must_run = ["torch-compile", "torch-eager", "te-bf16", "fp8-delayed", "fp8-current",
                "te-bf16-te-attn", "fp8-delayed-te-attn", "fp8-delayed-bf16ends"]
    must_run += [f"fp8-{r}" for r in ("block", "mxfp8", "tensorwise", "rowwise")
                 if get_engine(RECIPES[r].engine).available(r)[0]]  # torchao's where installed
    for name, r in results.items():
        if name in must_run:
            assert r["status"] == "ran", (name, r)
        else:
            assert r["status"] == "skipped" and r["reason"], (name, r)
    for name in must_run:
        r = results[name]
        for key in ("tokens_per_s", "ms_per_step", "tflops", "speedup", "peak_mem_gib", "loss"):
            assert math.isfinite(r[key]) and r[key] > 0, (name, key, r)
        assert r["mfu"] is None or 0 < r["mfu"] < 1, (name, r["mfu"])
        if name.startswith("fp8-"):
            assert r["precision"].startswith("FP8 "), (name, r["precision"])
    assert {"blocks.0", "blocks.3", "lm_head"} <= set(results["fp8-delayed-bf16ends"]["bf16_modules"])
    assert results["fp8-delayed"]["bf16_modules"] == ["lm_head"]


@pytest.mark.parametrize("variant,fp8,fp32_residual", [("torch-compile", False, True),
                                                      ("fp8-delayed-te-attn", True, False)])
def test_memory_estimate_tracks_the_measured_peak(bench_report, variant, fp8, fp32_residual):
    """fp8_lightning/memory.py against bench's measured peak of the same step, within the range
    measured on the H100 and H200 tables (0.91-1.30x; docs/benchmarks.md, "Peak memory")."""
    from fp8_lightning.config import GPTConfig
    from fp8_lightning.memory import GIB, RunShape, estimate_memory

    measured = {r["variant"]: r for r in bench_report["results"]}[variant]["peak_mem_gib"]
    config = GPTConfig.from_name("gpt2", n_layer=SMALL["n_layer"])
    estimate = estimate_memory(config, RunShape(SMALL["batch_size"], SMALL["seq_len"], fp8=fp8,
                                                fp32_residual=fp32_residual)).total / GIB
    print(f"\n[memory] {variant}: estimate {estimate:.2f} GiB, measured {measured:.2f} GiB "
          f"({estimate / measured:.2f}x)")
    assert 0.8 < estimate / measured < 1.4, (estimate, measured)


def test_bench_cli_on_gpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, "-m", "fp8_lightning", "bench", "--config", GPT2_FP8, "--variants",
         "te-bf16,fp8-delayed", "--steps", "3", "--warmup", "2", "--n_layer", "2",
         "--batch_size", "4", "--profile", "true", "--output_dir", str(tmp_path)],
        cwd=ROOT, env=env, text=True, capture_output=True, timeout=600)
    print(result.stdout)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fp8-delayed" in result.stdout and (tmp_path / "bench.png").is_file()
    # --profile: each variant's GPU kernel time by category, GEMMs among them
    assert "GPU kernel ms per step (profiler)" in result.stdout
    report = json.loads((tmp_path / "bench.json").read_text())
    for r in report["results"]:
        assert r.get("profile_ms", {}).get("gemm", 0) > 0, r


def test_doctor_probe_predicts_and_compares_with_bench(bench_report, tmp_path, capsys):
    code = doctor(GPT2_FP8, reps=5, output=str(tmp_path / "doctor.json"), **SMALL)
    out = capsys.readouterr().out
    print(out)
    keep(tmp_path / "doctor.json", "test_gpu_doctor.json")
    assert code == EXIT_OK
    assert "predicted step speedup of FP8 over te-bf16" in out
    assert "SDPA flash:" in out and "te.DotProductAttention" in out and "driver:" in out
    import json

    probe = json.loads((tmp_path / "doctor.json").read_text())["probe"]
    assert probe["step"]["status"] == "ran"
    assert all(t > 0 for t in probe["times_ms"]["bf16"])
    results = {r["variant"]: r for r in bench_report["results"]}
    for recipe, predicted in probe["speedup"].items():
        assert math.isfinite(predicted) and predicted > 0
        measured_run = results.get(f"fp8-{recipe}")
        if measured_run and measured_run["status"] == "ran":
            measured = results["te-bf16"]["ms_per_step"] / measured_run["ms_per_step"]
            print(f"probe vs bench, {recipe}: predicted {predicted:.2f}x, measured {measured:.2f}x, "
                  f"error {100 * (predicted - measured) / measured:+.0f}%")
