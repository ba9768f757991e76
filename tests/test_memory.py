"""The memory estimate (fp8_lightning/memory.py): what it counts, and what it says when a run
does not fit. Its agreement with measured peaks is a GPU test (test_gpu_bench.py)."""

import pytest

from fp8_lightning.config import GPTConfig
from fp8_lightning.flops import matmul_params
from fp8_lightning.memory import GIB, RunShape, estimate_memory, fit_problem, num_params
from fp8_lightning.model import GPT


@pytest.mark.parametrize("name,overrides", [("tiny", {}), ("tiny-llama", {}),
                                            ("tiny", {"tie_embeddings": False}),
                                            ("tiny-llama", {"bias": True, "qk_norm": False}),
                                            # Qwen2's QKV bias; an attention wider than the stream
                                            ("tiny-llama", {"qkv_bias": True, "head_size": 32})])
def test_parameter_count_is_the_models(name, overrides):
    config = GPTConfig.from_name(name, **overrides)
    model = GPT(config)
    assert num_params(config) == sum(p.numel() for p in model.parameters())
    gemms = [m.weight for n, m in model.named_modules() if n.endswith(("qkv", "proj", "lm_head"))]
    gemms += [p for n, p in model.named_parameters() if n.endswith(("fc1_weight", "fc2_weight"))]
    assert matmul_params(config) == sum(p.numel() for p in gemms)


def test_training_state_is_16_bytes_a_parameter_and_shards_split_it():
    config = GPTConfig.from_name("llama3-8b")
    p, gemm = num_params(config), matmul_params(config)
    one = estimate_memory(config, RunShape(batch_size=1, seq_len=8192))
    assert (one.gradients, one.optimizer) == (4 * p, 8 * p)
    assert one.weights == 4 * p + 2 * gemm  # fp32 masters + the GEMM weights' BF16/FP8 copies
    two = estimate_memory(config, RunShape(batch_size=1, seq_len=8192, shards=2))
    assert (two.gradients, two.optimizer) == (2 * p, 4 * p)
    assert two.activations == one.activations  # FSDP2 shards state, not a micro-batch
    # bf16-true: masters, gradients and AdamW's moments in BF16, half of everything
    half = estimate_memory(config, RunShape(batch_size=1, seq_len=8192, master_bytes=2))
    assert (half.gradients, half.optimizer) == (2 * p, 4 * p)


def test_the_peak_is_activations_or_gradients_unless_gradients_are_held():
    config = GPTConfig.from_name("gpt2")
    e = estimate_memory(config, RunShape(batch_size=8, seq_len=1024))
    assert e.total == e.weights + e.optimizer + max(e.activations + e.head_gradient, e.gradients)
    acc = estimate_memory(config, RunShape(batch_size=8, seq_len=1024, accumulate_grad_batches=4))
    assert acc.total == e.weights + e.optimizer + e.gradients + e.activations > e.total
    # FSDP2's whole-step CUDA graph adds into gradients that stay allocated: held as accumulated
    kept = estimate_memory(config, RunShape(batch_size=8, seq_len=1024, gradients_kept=True))
    assert kept.total == acc.total
    eager = estimate_memory(config, RunShape(batch_size=8, seq_len=1024, compiled_loss=False))
    assert eager.activations == e.activations + 8 * 8 * 1024 * config.padded_vocab_size  # fp32


def test_activations_scale_with_tokens_and_shrink_with_fp8_and_checkpointing():
    config = GPTConfig.from_name("gpt2")
    act = {}
    for key, run in {"base": RunShape(8, 1024), "double": RunShape(16, 1024),
                     "fp8": RunShape(8, 1024, fp8=True),
                     "mlp": RunShape(8, 1024, activation_checkpointing="mlp"),
                     "full/2": RunShape(8, 1024, activation_checkpointing="full",
                                        activation_checkpointing_every=2),
                     "full": RunShape(8, 1024, activation_checkpointing="full")}.items():
        act[key] = estimate_memory(config, run).activations
    assert act["double"] == 2 * act["base"]
    assert act["full"] < act["full/2"] < act["base"]
    assert act["full"] < act["mlp"] < act["base"] and act["fp8"] < act["base"]


def test_a_run_that_fits_has_no_problem_and_one_that_does_not_gets_checked_levers():
    config = GPTConfig.from_name("llama3-8b")
    run = RunShape(batch_size=1, seq_len=8192, fp8=True)
    assert fit_problem(config, run, 10_000 * GIB) is None
    problem = fit_problem(config, run, 80 * GIB)
    total = estimate_memory(config, run).total / GIB
    assert f"needs about {total:.1f} GiB per GPU" in problem and "80.0 GiB is free" in problem
    # 8B on one 80 GB GPU: states alone are 16 B x 8.0B; activation checkpointing cannot help,
    # sharding can, and each lever says which (the GPU count over nodes, the fewest that fit).
    lever = problem.split("model.activation_checkpointing: full -> ")[1].split(";")[0]
    assert lever.endswith("(not enough)")
    gpus = int(problem.split("; FSDP2 over ")[1].split(" GPUs")[0])
    assert "(not enough)" not in problem.split("; FSDP2 over ")[1]
    assert "trainer.devices x trainer.num_nodes" in problem
    assert fit_problem(config, RunShape(1, 8192, fp8=True, shards=gpus), 80 * GIB) is None
    assert fit_problem(config, RunShape(1, 8192, fp8=True, shards=gpus // 2), 80 * GIB)
    # Eight sequences: neither lever alone is enough; checkpointing and sharding together are.
    problem = fit_problem(config, RunShape(8, 8192, fp8=True), 80 * GIB)
    assert "model.activation_checkpointing: full and FSDP2 over" in problem
    assert problem.count("(not enough)") == 2 and not problem.endswith("(not enough)")
    assert ": mlp" not in problem  # (offered only where it is enough)


def test_without_checkpointing_the_cheaper_mlp_recompute_is_the_first_lever():
    """Llama-3-8B on two 80 GB H100s under FSDP2 without activation checkpointing (94 GiB): the
    first lever is mlp (it fits, and recomputes less than full), then full; where mlp is not
    enough it is not offered."""
    config = GPTConfig.from_name("llama3-8b")
    problem = fit_problem(config, RunShape(1, 8192, shards=2, fp8=True), 77.4 * GIB, gpus=2)
    levers = problem.split("levers: ")[1].split("; ")
    mlp = estimate_memory(config, RunShape(1, 8192, shards=2, fp8=True,
                                           activation_checkpointing="mlp")).total / GIB
    assert levers[0] == f"model.activation_checkpointing: mlp -> {mlp:.1f} GiB"
    assert levers[1].startswith("model.activation_checkpointing: full -> ")
    # a run already recomputing its MLPs is offered full, not mlp again
    problem = fit_problem(config, RunShape(1, 8192, shards=2, fp8=True,
                                           activation_checkpointing="mlp"), 60 * GIB, gpus=2)
    assert ": mlp" not in problem and "model.activation_checkpointing: full" in problem
    # one block in two recomputing its MLPs: mlp on every block, said so (the lever's estimate)
    problem = fit_problem(config, RunShape(1, 8192, shards=2, fp8=True, activation_checkpointing="mlp",
                                           activation_checkpointing_every=2), 77.4 * GIB, gpus=2)
    assert problem.split("levers: ")[1].startswith(
        f"model.activation_checkpointing: mlp, model.activation_checkpointing_every: 1 -> {mlp:.1f} GiB")


@pytest.mark.parametrize("name, run, peak_gib", [
    # two H200s, FSDP2, TE FP8 delayed (the runs of docs/benchmarks.md): Llama-3-8B at full depth,
    # 1 x 8192 a GPU, every block checkpointed, weights freed after forward
    ("llama3-8b", dict(batch_size=1, seq_len=8192, shards=2, fp8=True,
                       activation_checkpointing="full"), 66.9),
    # two H100s, FSDP2, selective checkpointing (mlp), the gradients dropped after each optimizer
    # step: TE FP8 delayed, and the BF16 twin (PyTorch backend, fp32 residual stream)
    ("llama3-8b", dict(batch_size=1, seq_len=8192, shards=2, fp8=True,
                       activation_checkpointing="mlp"), 64.8),
    ("llama3-8b", dict(batch_size=1, seq_len=8192, shards=2, fp32_residual=True,
                       activation_checkpointing="mlp"), 64.8),
    # the 1.3B, 8 x 1024 a GPU, weights kept gathered from forward to backward
    ("gpt-1.3b", dict(batch_size=8, seq_len=1024, shards=2, fp8=True, keep_gathered=True), 24.0),
])
def test_the_estimate_is_within_10_percent_of_measured_fsdp2_peaks(name, run, peak_gib):
    """The memory check against peaks measured on GPUs (torch.cuda.max_memory_allocated of rank
    0 in training, docs/benchmarks.md): within 10%."""
    config = GPTConfig.from_name(name)
    estimate = estimate_memory(config, RunShape(**run)).total / GIB
    assert abs(estimate - peak_gib) <= 0.10 * peak_gib, (estimate, peak_gib)
