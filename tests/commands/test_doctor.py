"""``doctor`` on CPU: reasons, exit codes, config lint, and the probe's arithmetic."""

import json
import re
from pathlib import Path

import pytest
import torch

from fp8_lightning.commands.doctor import (EXIT_BAD_CONFIG, EXIT_FP8_UNUSABLE, EXIT_OK, cudnn_text,
                                           doctor, model_gemms, predict, suggest)
from fp8_lightning.config import GPTConfig
from fp8_lightning.te_availability import fallback_precision
from tests._runs import run_main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_doctor(capsys, monkeypatch):
    """``python -m fp8_lightning doctor ARGS`` from the repository root, in this process (its exit
    status and output are under test, not Python's start-up): (exit status, stdout, stderr)."""
    monkeypatch.chdir(ROOT)
    return lambda *args: run_main(capsys, ["doctor", *args])


def test_cli_fp8_requested_on_cpu_exits_1_with_the_reason(tmp_path, run_doctor):
    code, out, err = run_doctor("--config", "configs/quickstart.yaml", "--output",
                                str(tmp_path / "d.json"))
    assert code == EXIT_FP8_UNUSABLE, err[-2000:]
    assert "FP8 delayed is requested but CANNOT run here" in out
    assert "TransformerEngine is not installed" in out or "no CUDA GPU" in out
    assert "FP8 needs an NVIDIA GPU with compute capability >= 8.9" in out
    for section in ("Environment", "Attention backends", "FP8 per recipe", "Config lint", "Verdict"):
        assert f"== {section}" in out
    assert "torch: " in out and "no errors" in out
    # torch's build, not a GPU: labelled as such, and the fallback named as what really runs.
    if not torch.cuda.is_available():
        assert "no CUDA GPU visible" in out
        assert re.search(r"^  cuda: torch built with(out)? CUDA", out, re.M)
        assert not re.search(r"^  cuda: [\d.]+$", out, re.M), out
        assert not re.search(r"^  cudnn: \d+$", out, re.M), out
        assert f"would fall back to {fallback_precision()[1]}" in out
    report = json.loads((tmp_path / "d.json").read_text())
    assert report["exit_status"] == 1 and not report["recipes"]["delayed"]["available"]


def test_bf16_config_on_cpu_exits_0_and_explains(capsys):
    assert doctor(str(ROOT / "configs" / "gpt2_bf16.yaml")) == EXIT_OK
    out = capsys.readouterr().out
    assert "the config trains BF16" in out and "FP8 needs" in out
    assert "16 x 1024 = 16384 tokens" in out and "padded to 50304" in out


def test_no_config_reports_the_environment(capsys):
    assert doctor() == EXIT_OK
    out = capsys.readouterr().out
    assert "delayed" in out and "NOT available" in out and "give --config" in out


def test_cli_bad_dims_and_plugin_fields_exit_2_naming_the_fields(tmp_path, run_doctor):
    text = (ROOT / "configs" / "quickstart.yaml").read_text()
    text = text.replace("name: tiny", "name: tiny\n    n_embd: 100")
    text = text.replace("recipe: delayed", "recipe: delayed\n        interval: 1")
    text = text.replace("batch_size: 8", "batch_size: 3")
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    code, out, err = run_doctor("--config", str(cfg))
    assert code == EXIT_BAD_CONFIG, err[-2000:]
    assert "ERROR model.config: n_embd=100 is not a multiple of 16" in out
    assert "nearest valid: 96" in out
    assert "ERROR trainer.plugins FP8Precision: interval: removed in TransformerEngine 2.x" in out


def test_lint_catches_micro_batch_and_fp8_lm_head(tmp_path, capsys):
    text = (ROOT / "configs" / "gpt2_fp8.yaml").read_text().replace("fp8_lm_head: false",
                                                                   "fp8_lm_head: true")
    cfg = tmp_path / "lmhead.yaml"
    cfg.write_text(text)
    assert doctor(str(cfg), batch_size=3, seq_len=50) == EXIT_BAD_CONFIG
    out = capsys.readouterr().out
    assert "3 x seq_len=50 = 150 tokens per micro-batch is not a multiple of 16" in out
    assert "WARNING fp8_lm_head=true" in out


def test_missing_config_is_one_error_line(run_doctor):
    code, _, err = run_doctor("--config", "configs/nope.yaml")
    assert code == 2
    assert "error: config file not found: configs/nope.yaml" in err
    assert "Traceback" not in err


def test_model_gemms_follow_the_layer_policy():
    gemms = {g.label: g for g in model_gemms(GPTConfig(name="gpt2"), bf16_first_layers=1,
                                             bf16_last_layers=2)}
    assert set(gemms) == {"qkv", "proj", "mlp.fc1", "mlp.fc2", "lm_head"}
    assert (gemms["qkv"].n_in, gemms["qkv"].n_out, gemms["qkv"].fp8, gemms["qkv"].bf16) == (768, 2304, 9, 3)
    assert (gemms["mlp.fc2"].n_in, gemms["mlp.fc2"].n_out) == (3072, 768)
    assert (gemms["lm_head"].n_out, gemms["lm_head"].fp8, gemms["lm_head"].bf16) == (50304, 0, 1)
    llama = {g.label: g for g in model_gemms(GPTConfig(name="llama3-8b"), fp8_lm_head=True)}
    assert llama["mlp.fc1"].n_out == 2 * 14336 and llama["qkv"].n_out == 6144  # SwiGLU, GQA
    assert llama["lm_head"].fp8 == 1 and not llama["qkv"].bias


def test_prediction_keeps_non_gemm_time_and_flags_slower_shapes():
    gemms = model_gemms(GPTConfig(name="gpt2"))  # 12 x (qkv, proj, fc1, fc2) FP8 + BF16 head
    times = {"bf16": [1.0, 1.0, 2.0, 2.0, 4.0], "delayed": [0.5, 1.25, 1.0, 1.0, 2.0],
             "block": [2.0, 2.0, 4.0, 4.0, 8.0]}
    pred = predict(gemms, times, step_ms=100.0)
    assert pred["gemm_bf16_ms"] == 12 * 6 + 4 and pred["other_ms"] == 24.0
    assert pred["speedup"]["delayed"] == pytest.approx(100 / (24 + 12 * 3.75 + 4))
    assert pred["fp8_slower"]["delayed"] == ["proj"]
    assert pred["speedup_slower_in_bf16"]["delayed"] == pytest.approx(100 / (24 + 12 * 3.5 + 4))
    assert pred["speedup"]["block"] < 1.0
    lines = suggest(pred, {})
    assert any("keep the small projections" in line and "proj" in line for line in lines)
    assert any("fastest predicted recipe here: delayed" in line for line in lines)
    slow = predict(gemms, {"bf16": times["bf16"], "block": times["block"]}, step_ms=None)
    assert slow["speedup"]["block"] == pytest.approx(76 / (12 * 12 + 4))  # GEMM time only
    assert any("does not pay" in line for line in suggest(slow, {}))


def test_cudnn_version_text():
    assert cudnn_text(92400) == "9.24.0" and cudnn_text(90100) == "9.1.0"
    assert cudnn_text(8902) == "8.9.2"


@pytest.fixture
def old_te(monkeypatch):
    """TransformerEngine 2.10 installed: below the floor this code needs."""
    from fp8_lightning import te_availability

    monkeypatch.setattr(te_availability, "TE_REQUIREMENT", False)
    monkeypatch.setattr(te_availability, "te_version", lambda: "2.10.0")
    te_availability.te_status.cache_clear()
    yield
    te_availability.te_status.cache_clear()


def test_too_old_transformer_engine_is_a_reason_not_a_crash(old_te, capsys):
    from fp8_lightning.fp8.te_engine import recipe_available
    from fp8_lightning.te_availability import TE_MIN_VERSION, te_status

    reason = 'TransformerEngine 2.10.0 found, >= 2.18 needed (pip install -U "fp8-lightning[te]")'
    assert TE_MIN_VERSION == "2.18" and te_status() == (False, reason)
    assert recipe_available("delayed") == (False, reason)  # the plugin's fallback reason
    assert doctor(str(ROOT / "configs" / "quickstart.yaml")) == EXIT_FP8_UNUSABLE
    out = capsys.readouterr().out
    assert f"transformer_engine_status: {reason}" in out
    assert "FP8 delayed is requested but CANNOT run here" in out and "TransformerEngine >= 2.18" in out
