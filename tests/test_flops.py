"""FLOPs per token, the peak table and MFU, by hand (``fp8_lightning/flops.py``)."""

import pytest

from fp8_lightning import flops
from fp8_lightning.config import GPTConfig


# ----------------------------------------------------------------------------- MFU arithmetic
def test_flops_per_token_by_hand():
    # GPT-2 124M: per layer QKV 768*2304 + out 768*768 + MLP 2*768*3072 = 7,077,888; x12 = 84,934,656
    # plus the LM head 50304*768 = 38,633,472 -> 123,568,128 matmul params.
    gpt2 = GPTConfig(name="gpt2")
    assert flops.matmul_params(gpt2) == 123_568_128
    # 6 * 123,568,128 + 12 * 12 layers * 1024 * 768 = 741,408,768 + 113,246,208
    assert flops.flops_per_token(gpt2) == 854_654_976
    assert flops.flops_per_token(gpt2, seq_len=512) == 741_408_768 + 56_623_104
    # GPT-2 medium: 24 * (1024*3072 + 1024^2 + 2*1024*4096) + 50304*1024 = 353,501,184
    medium = GPTConfig(name="gpt2-medium")
    assert flops.flops_per_token(medium) == 6 * 353_501_184 + 12 * 24 * 1024 * 1024
    # Llama 3 8B: GQA QKV (32+2*8)*128 = 6144 wide, SwiGLU 3 matrices, vocab 128256 (x128 already)
    llama = GPTConfig(name="llama3-8b")
    per_layer = 4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336
    assert flops.matmul_params(llama) == 32 * per_layer + 128256 * 4096 == 7_504_658_432
    assert flops.flops_per_token(llama) == 6 * 7_504_658_432 + 12 * 32 * 8192 * 4096


@pytest.mark.parametrize("name,bf16,fp8", [
    ("NVIDIA H100 80GB HBM3", 989.4e12, 1978.9e12),
    ("NVIDIA H100 PCIe", 756.5e12, 1513e12),
    ("NVIDIA H100 NVL", 835.5e12, 1671e12),
    ("NVIDIA H200", 989.4e12, 1978.9e12),
    ("NVIDIA H200 NVL", 835.5e12, 1671e12),
    ("NVIDIA GH200 480GB", 989.4e12, 1978.9e12),
    ("NVIDIA A100-SXM4-80GB", 312e12, None),
    ("NVIDIA A100 80GB PCIe", 312e12, None),
    ("NVIDIA L40S", 362.05e12, 733e12),
    ("NVIDIA L4", 121e12, 242.5e12),
    ("NVIDIA RTX 6000 Ada Generation", 364.2e12, 728.5e12),
])
def test_peak_table_by_device_name(name, bf16, fp8):
    peak = flops.peak_for(name)
    assert peak is not None and peak.bf16 == bf16 and peak.fp8 == fp8


def test_unknown_device_has_no_peak_and_no_mfu():
    assert flops.peak_for("NVIDIA GeForce GTX 1080") is None
    assert flops.mfu(1e6, 1e9, None) is None


def test_mfu_by_hand():
    f = 854_654_976  # GPT-2 124M at T=1024
    h100 = flops.peak_for("NVIDIA H100 80GB HBM3")
    # 400,000 tok/s * 854,654,976 FLOP = 3.41862e14 FLOP/s
    assert flops.mfu(400_000, f, h100.bf16) == pytest.approx(3.418619904e14 / 989.4e12)
    assert flops.mfu(400_000, f, h100.bf16) == pytest.approx(0.345524, abs=1e-6)
    assert flops.mfu(400_000, f, h100.fp8) == pytest.approx(0.172753, abs=1e-6)
    h200 = flops.peak_for("NVIDIA H200")
    assert flops.mfu(250_000, f, h200.bf16) == pytest.approx(0.215953, abs=1e-6)
    a100 = flops.peak_for("NVIDIA A100-SXM4-40GB")
    assert flops.mfu(100_000, f, a100.bf16) == pytest.approx(0.273928, abs=1e-6)
    assert a100.fp8 is None and flops.mfu(100_000, f, a100.fp8) is None
