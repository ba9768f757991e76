"""StepProfile: the split of a step's time (the arithmetic on kernel intervals here; the split of
real DDP steps on two GPUs in tests/test_gpu_ddp.py)."""

import json

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from fp8_lightning.callbacks.profile import (StepProfile, format_split, kernel_summary, split_step,
                                             union_length)
from fp8_lightning.config import ConfigError, GPTConfig
from fp8_lightning.module import GPTLightningModule
from tests.helpers import VOCAB, Tokens


def test_union_counts_overlaps_once():
    assert union_length([]) == 0
    assert union_length([(0, 10), (5, 15), (20, 30)]) == 25
    assert union_length([(20, 30), (0, 40)]) == 40  # unsorted, nested


def test_the_step_is_compute_plus_exposed_communication_plus_idle():
    # Intervals in us over two steps of 40 ms: compute at 0-10 and 20-30 ms, an all-reduce at
    # 5-25 ms (half of it behind compute), no kernel at 30-80 ms.
    kernels = [("sm90_gemm_bf16", 0, 10_000), ("ncclDevKernel_AllReduce_Sum_f32", 5_000, 25_000),
               ("elementwise_kernel", 20_000, 30_000)]
    split = split_step(kernels, wall_ms=80.0, steps=2, host_wait_ms=4.0)
    assert split == {"step_ms": 40.0, "compute_ms": 10.0, "exposed_comm_ms": 5.0,
                     "gpu_idle_ms": 25.0, "comm_ms": 10.0, "host_wait_ms": 2.0}
    assert split["compute_ms"] + split["exposed_comm_ms"] + split["gpu_idle_ms"] == split["step_ms"]


def test_communication_fully_behind_compute_is_not_exposed():
    kernels = [("gemm", 0, 10_000), ("ncclKernel_ReduceScatter", 2_000, 8_000)]
    split = split_step(kernels, wall_ms=10.0, steps=1)
    assert split["exposed_comm_ms"] == 0 and split["comm_ms"] == 6.0 and split["gpu_idle_ms"] == 0


def test_kernel_time_adds_up_by_category_and_ranks_the_kernels():
    # two steps: a GEMM of 3 ms a step, a cast of 1 ms called twice a step, an add
    kernels = [("sm90_xmma_gemm_e4m3", 0, 3_000), ("sm90_xmma_gemm_e4m3", 10_000, 13_000),
               ("cast_transpose_fp8", 3_000, 3_500), ("cast_transpose_fp8", 4_000, 4_500),
               ("cast_transpose_fp8", 13_000, 13_500), ("cast_transpose_fp8", 14_000, 14_500),
               ("vectorized_elementwise_kernel<add>", 5_000, 5_200)]
    summary = kernel_summary(kernels, steps=2, top=2)
    assert summary["categories"] == {"fp8 cast/transpose/amax": 1.0, "gemm": 3.0, "other": 0.1,
                                     "total": 4.1}
    assert summary["top"] == [["sm90_xmma_gemm_e4m3", "gemm", 3.0, 1.0],
                              ["cast_transpose_fp8", "fp8 cast/transpose/amax", 1.0, 2.0]]


@pytest.mark.parametrize("name, category", [
    # a compiled LayerNorm's backward, not the clip's norm
    ("triton_per_fused__to_copy_add_native_layer_norm_backward_view_7", "other"),
    ("multi_tensor_apply_kernel<TensorListMetadata<1>, LpNormFunctor<float>>", "optimizer"),
    ("reduce_kernel<512, 1, ReduceOp<float, NormTwoOps<float>>>", "optimizer"),
    # PyTorch's dtype handling in an eager model's elementwise ops, not FP8 casts
    ("elementwise_kernel<128, 2, gpu_kernel_impl_nocast<BinaryFunctor<float, float, float, "
     "MulFunctor<float>>>>", "other"),
    ("unrolled_elementwise_kernel<MulFunctor<float>, Array<char*, 3>, TrivialOffsetCalculator<2>, "
     "TrivialOffsetCalculator<1>, LoadWithCast<2>, StoreWithCast<1>>", "other"),
    ("split_with_sizes_copy_out_contiguous_no_cast_kernel", "other"),
    # an FP8 GEMM of PyTorch's _scaled_mm is a GEMM
    ("cutlass::device_kernel<KernelTmaWarpSpecializedPingpongFP8FastAccum>", "gemm"),
    ("cast_transpose_optimized_kernel<__nv_bfloat16, __nv_fp8_e4m3>", "fp8 cast/transpose/amax"),
])
def test_kernels_named_like_another_category_count_where_they_belong(name, category):
    from fp8_lightning.measure import kernel_category

    assert kernel_category(name) == category


def test_the_table_has_a_row_per_rank():
    rows = [split_step([("gemm", 0, 1_000)], 2.0, 1), split_step([("gemm", 0, 1_500)], 2.0, 1)]
    text = format_split(rows, 20, 1).splitlines()
    assert text[0].startswith("profile: steps 20-20") and len(text) == 4
    assert text[2].split()[:3] == ["0", "2.00", "1.00"] and text[3].split()[:3] == ["1", "2.00", "1.50"]


@pytest.mark.parametrize("args", [{"start_step": -1}, {"steps": 0}, {"top": 0}])
def test_bad_window_is_one_config_error(args):
    with pytest.raises(ConfigError, match="start_step >= 0, steps >= 1 and top >= 1"):
        StepProfile(**args)


def test_a_cpu_fit_reports_the_step_time_and_leaves_the_gpu_split_unknown(tmp_path):
    profile = StepProfile(start_step=2, steps=3)
    module = GPTLightningModule(config=GPTConfig(name="tiny", n_layer=1, block_size=32,
                                                 vocab_size=VOCAB), warmup_steps=1)
    trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=CSVLogger(tmp_path),
                        enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[profile], default_root_dir=tmp_path)
    trainer.fit(module, torch.utils.data.DataLoader(Tokens(), batch_size=4))
    (row,) = profile.result
    assert row["step_ms"] > 0 and row["compute_ms"] is None and row["exposed_comm_ms"] is None
    saved = json.loads((tmp_path / "lightning_logs" / "version_0" / "step_profile.json").read_text())
    assert saved["first_step"] == 2 and saved["steps"] == 3 and saved["ranks"] == profile.result


def test_a_run_that_ends_inside_the_window_reports_the_steps_it_ran(tmp_path):
    profile = StepProfile(start_step=2, steps=10)
    module = GPTLightningModule(config=GPTConfig(name="tiny", n_layer=1, block_size=32,
                                                 vocab_size=VOCAB), warmup_steps=1)
    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[profile],
                        default_root_dir=tmp_path)
    trainer.fit(module, torch.utils.data.DataLoader(Tokens(), batch_size=4))
    assert profile.result is not None and profile.result[0]["step_ms"] > 0
    assert not list(tmp_path.rglob("step_profile.json"))  # no logger, no file


def test_the_bench_profile_and_the_callback_share_one_kernel_table():
    """measure.profile_step (bench --profile) and StepProfile (kernel_summary) rank and sum the
    kernels the same way: one table from each kernel's ms and calls a step."""
    from fp8_lightning.measure import kernel_table

    totals, top = kernel_table({"nvjet_sm90_tst_gemm": (3.0, 1.0), "cast_transpose_fp8": (1.0, 2.0),
                                "elementwise_kernel<add>": (0.1, 1.0)}, top=2)
    assert totals == {"fp8 cast/transpose/amax": 1.0, "gemm": 3.0, "other": 0.1, "total": 4.1}
    assert top == [["nvjet_sm90_tst_gemm", "gemm", 3.0, 1.0],
                   ["cast_transpose_fp8", "fp8 cast/transpose/amax", 1.0, 2.0]]
    events = [("nvjet_sm90_tst_gemm", 0, 3_000), ("cast_transpose_fp8", 3_000, 3_500),
              ("cast_transpose_fp8", 4_000, 4_500), ("elementwise_kernel<add>", 5_000, 5_100)]
    assert kernel_summary(events, steps=1, top=2) == {"categories": totals, "top": top}
