"""GPU tests on two GPUs: FP8 under DDP (compiled regions, a CUDA graph per block with DDP's
all-reduce between the replays) and under FSDP2 (its chosen layout) trains as one GPU reading the
same samples, StepProfile splits the step under the real strategy, activation checkpointing
under FSDP2 gives no checkpointing's gradients, HSDP (two replicas) trains as FSDP2, the Fabric
example resumes under FSDP2, a user's own model (examples/own_model.py) replays its blocks
under DDP with cached FP8 weights, and a user's Hugging Face Llama (examples/hf_llama.py) trains
FP8 under FSDP2Strategy, resumes and exports.

`python -m pytest -m gpu tests/test_gpu_ddp.py -s` on a machine with two GPUs (they skip with
fewer, or without CUDA/TE).
"""

import re

import pytest
import torch

from fp8_lightning.te_availability import te_status
from tests._runs import run_cli

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two GPUs")]
needs_te = pytest.mark.skipif(not te_status()[0], reason="needs TE")

LOSS = re.compile(r"^step (\d+) \| loss ([\d.]+)", re.M)
# GPT-2 shape cut to 4 blocks (FP8 delayed unless a test says), 8 x 1024 per rank, on the
# embedded corpus
ARGS = ["--model.config.n_layer", "4", "--data.batch_size", "8",
        "--trainer.max_steps", "30", "--trainer.log_every_n_steps", "10",
        "--trainer.limit_val_batches", "0", "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false", "--model.warmup_steps", "10",
        "--trainer.callbacks", "[{class_path: fp8_lightning.NaNGuard}, {class_path: "
        "fp8_lightning.TrainingMonitor, init_args: {sample_prompt: null}}]"]


def fit(root, *args, config="configs/gpt2_fp8.yaml"):
    result = run_cli("fit", "--config", config, *ARGS, "--trainer.default_root_dir", str(root),
                     *args, timeout=900)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    return out, {int(s): float(v) for s, v in LOSS.findall(out)}


@pytest.fixture(scope="module")
def one_gpu_losses(tmp_path_factory):
    """The reference: one GPU reading, at every step, the samples of both ranks."""
    _, losses = fit(tmp_path_factory.mktemp("one"), "--trainer.devices", "1",
                    "--data.emulate_ranks", "2", "--trainer.accumulate_grad_batches", "2")
    return losses


@needs_te
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp-units"])
def test_fp8_on_two_gpus_takes_the_fast_path_and_trains_as_one_gpu(tmp_path, strategy,
                                                                   one_gpu_losses):
    """DDP: compiled regions and a CUDA graph per block, DDP's all-reduce between the replays.
    FSDP2: the layout chosen for a model that fits one GPU (weights kept gathered, one unit; or a
    unit per block, as a model of several units has), the loss compiled, the step's forward and
    backward one CUDA graph, and the process ends (a graph of NCCL collectives outliving the
    process group hangs the exit). Either way FP8 runs, StepProfile splits the step per rank, and
    the losses are the one-GPU run's within FP8 tolerance."""
    units = ["--trainer.strategy.init_args.blocks_per_unit", "1"] if strategy == "fsdp-units" else []
    out, losses = fit(tmp_path / strategy, "--config", f"configs/{strategy.split('-')[0]}.yaml",
                      "--trainer.devices", "2", "--trainer.callbacks+=fp8_lightning.StepProfile",
                      "--trainer.callbacks.start_step", "12", "--trainer.callbacks.steps", "3",
                      *units)
    if strategy == "ddp":
        assert "compile: the regions between TE modules" in out
        assert "CUDA graphs: on" in out and "4 blocks captured as a graph each" in out
    else:
        assert f"FSDP2: 4 blocks in {4 if units else 1} unit(s)" in out, out[-4000:]
        assert "kept gathered" in out, out[-4000:]
        assert "compile: the loss" in out and "the TE blocks run uncompiled in the step's CUDA graph" in out
        assert "CUDA graphs: on, the step's forward and backward as one graph" in out
        assert "the step's forward and backward captured for micro-batch 8x1024 (FP8)" in out
    assert "FP8 verified" in out
    # the profile: a row per rank whose parts add up to the step
    rows = re.findall(r"^([01]) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+)", out, re.M)
    assert sorted(r[0] for r in rows) == ["0", "1"]
    for _, step, compute, exposed, idle in rows:
        assert abs(float(compute) + float(exposed) + float(idle) - float(step)) < 0.01 * float(step)
        assert float(compute) > 0
    assert sorted(losses) == sorted(one_gpu_losses) == [10, 20, 30]
    worst = max(abs(losses[s] - one_gpu_losses[s]) / one_gpu_losses[s] for s in one_gpu_losses)
    print(f"\n[{strategy} 2 GPUs vs 1 GPU] losses {losses} vs {one_gpu_losses}, worst gap {worst:.4f}")
    assert losses[30] < losses[10] - 0.5 and worst < 0.03


def test_bf16_on_the_pytorch_backend_replays_a_compiled_graph_per_block_under_ddp(tmp_path):
    """The package's BF16 baseline under DDP: each block compiled, then captured as its own CUDA
    graph, DDP's all-reduce between the replays; the losses are those of one GPU reading both
    ranks' samples, within BF16 tolerance, and both ranks end with the same weights."""
    bf16 = "configs/gpt2_bf16.yaml"
    _, one = fit(tmp_path / "one", "--trainer.devices", "1", "--data.emulate_ranks", "2",
                 "--trainer.accumulate_grad_batches", "2", config=bf16)
    out, losses = fit(tmp_path / "ddp", "--config", "configs/ddp.yaml", "--trainer.devices", "2",
                      "--trainer.callbacks+=tests.helpers.RankDigest",
                      "--trainer.callbacks.path", str(tmp_path / "digests"), config=bf16)
    assert "compile: each block and the loss, for a CUDA graph per block" in out, out[-4000:]
    assert "CUDA graphs: on, a graph per block" in out
    assert "4 blocks captured as a graph each for micro-batch 8x1024 (BF16)" in out
    assert sorted(losses) == sorted(one) == [10, 20, 30]
    worst = max(abs(losses[s] - one[s]) / one[s] for s in one)
    print(f"\n[BF16 DDP 2 GPUs vs 1 GPU] losses {losses} vs {one}, worst gap {worst:.4f}")
    assert losses[30] < losses[10] - 0.5 and worst < 0.02
    # the replicas took the same steps: every gradient reached DDP's all-reduce
    digests = [p.read_text() for p in sorted((tmp_path / "digests").glob("rank*.txt"))]
    assert len(digests) == 2 and digests[0] == digests[1]


@needs_te
def test_hsdp_of_two_replicas_on_two_gpus_trains_fp8_as_plain_fsdp2(tmp_path):
    """``FSDP2Strategy(replicate=2)`` on two GPUs: HSDP 2x1, two replicas of one shard each (the
    one HSDP layout two GPUs have; gradients all-reduced across the replicas, TE's amax over
    both ranks). FP8 delayed runs, the log names the mesh, the losses are finite and those of
    plain FSDP2 on the same two GPUs (every rank reads its own samples either way) within FP8
    tolerance."""
    _, plain = fit(tmp_path / "fsdp", "--config", "configs/fsdp.yaml", "--trainer.devices", "2")
    out, hsdp = fit(tmp_path / "hsdp", "--config", "configs/fsdp.yaml", "--trainer.devices", "2",
                    "--trainer.strategy.init_args.replicate", "2")
    assert "FSDP2: HSDP, 2 replicas x 1 shard (all-gathers within a replica group)" in out, \
        out[-4000:]
    assert "FP8 verified" in out and "NaN guard: skipped" not in out
    assert sorted(hsdp) == sorted(plain) == [10, 20, 30]
    worst = max(abs(hsdp[s] - plain[s]) / plain[s] for s in plain)
    print(f"\n[HSDP 2x1 vs FSDP2, 2 GPUs] losses {hsdp} vs {plain}, worst gap {worst:.4f}")
    assert hsdp[30] < hsdp[10] - 0.5 and worst < 0.03


@pytest.mark.parametrize("precision", ["bf16", "tensorwise"])
def test_the_pytorch_backend_under_fsdp2_compiles_each_block_before_sharding(tmp_path, precision):
    """FSDP2 as torchtitan runs it: the PyTorch backend's blocks (BF16, or torchao float8 with
    the weights gathered as float8 by default) each compiled before they are sharded, FSDP2's
    hooks outside the graphs; the losses are one GPU's reading both ranks' samples."""
    if precision == "bf16":
        config, extra = "configs/gpt2_bf16.yaml", []
    else:
        pytest.importorskip("torchao")
        config = "configs/gpt2_fp8.yaml"
        extra = ["--trainer.plugins.init_args.recipe", "tensorwise", "--model.attention", "sdpa"]
    _, one = fit(tmp_path / "one", "--trainer.devices", "1", "--data.emulate_ranks", "2",
                 "--trainer.accumulate_grad_batches", "2", *extra, config=config)
    out, losses = fit(tmp_path / "fsdp", "--config", "configs/fsdp.yaml", "--trainer.devices", "2",
                      *extra, config=config)
    assert "compile: each block and the loss" in out, out[-4000:]
    if precision == "tensorwise":
        assert "GEMM weights gather as float8" in out and "FP8 verified" in out
    assert sorted(losses) == sorted(one) == [10, 20, 30]
    worst = max(abs(losses[s] - one[s]) / one[s] for s in one)
    print(f"\n[{precision} FSDP2 2 GPUs vs 1 GPU] losses {losses} vs {one}, worst gap {worst:.4f}")
    assert losses[30] < losses[10] - 0.5 and worst < 0.03


@needs_te
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-delayed"])
def test_activation_checkpointing_under_fsdp2_matches_none_on_two_gpus(tmp_path, fp8):
    """TE blocks sharded with FSDP2 on two GPUs: recomputing them (full, mlp) gives the gradients
    of no checkpointing: finite and bit-identical in BF16; in FP8 finite, with the total gradient
    norm within 2% (TE's LayerNormMLP recompute under delayed scaling is not bit-identical)."""
    from tests.test_fsdp2 import run_two_ranks

    grads = run_two_ranks(tmp_path, ("none", "full", "mlp"), backend="te", fp8=fp8)
    params = [n for n in grads["none"] if n != "loss"]
    norm = {mode: torch.stack([grads[mode][n].float().norm() for n in params]).norm().item()
            for mode in grads}
    for mode in ("full", "mlp"):
        assert all(torch.isfinite(grads[mode][n]).all() for n in params), mode
        worst = max(((grads[mode][n].float() - grads["none"][n].float()).norm()
                     / grads["none"][n].float().norm().clamp_min(1e-12)).item() for n in params)
        exact = all(torch.equal(grads[mode][n], grads["none"][n]) for n in params)
        print(f"\n[FSDP2 {'FP8' if fp8 else 'BF16'} {mode} vs none] gradient norm {norm[mode]:.4f} "
              f"vs {norm['none']:.4f}, worst tensor's relative gap {worst:.2e}, bit-identical: {exact}")
        if fp8:
            assert abs(norm[mode] - norm["none"]) < 0.02 * norm["none"], (mode, norm)
        else:
            assert exact, (mode, worst)


@needs_te
def test_fabric_example_trains_fp8_under_fsdp2_on_two_gpus_and_resumes(tmp_path):
    """``examples/fabric_train.py --strategy fsdp --devices 2``: FabricFP8Precision under Fabric's
    ModelParallelStrategy (FSDP2 in units of blocks) runs FP8, writes a directory of shards, and a resumed
    run's loss follows the uninterrupted one's."""
    import subprocess
    import sys

    from tests._runs import ROOT

    def run(ckpt, steps):
        result = subprocess.run(
            [sys.executable, "examples/fabric_train.py", "--ckpt", str(ckpt), "--model", "gpt2",
             "--n_layer", "2", "--batch_size", "4", "--seq_len", "256", "--corpus_chars", "200000",
             "--log_every", "2", "--save_every", "4", "--steps", str(steps), "--devices", "2",
             "--strategy", "fsdp"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout, dict(re.findall(r"^step +(\d+) \| loss ([\d.]+)", result.stdout, re.M))

    out, whole = run(tmp_path / "whole.ckpt", 6)
    assert "precision: FP8 delayed" in out and "| fp8-delayed" in out, out[-2000:]
    assert "CUDA graphs: off (FSDP2's hooks run in Python" in out
    run(tmp_path / "last.ckpt", 4)
    assert len(list((tmp_path / "last.ckpt").glob("*.distcp"))) == 2  # one shard per rank
    out, resumed = run(tmp_path / "last.ckpt", 6)
    assert "at step 4" in out and sorted(resumed) == ["6"], out[-2000:]
    print(f"\n[Fabric FSDP2 2 GPUs] step-6 loss resumed {resumed['6']} vs whole {whole['6']}")
    assert abs(float(resumed["6"]) - float(whole["6"])) < 0.02 * float(whole["6"])


@needs_te
def test_fabric_example_replays_a_graph_per_block_under_ddp_and_trains_as_eager(tmp_path):
    """``examples/fabric_train.py --strategy ddp --devices 2``: each TE block captured as its own
    CUDA graph (DDP's all-reduce between the replays), the loss curve that of the eager blocks."""
    import subprocess
    import sys

    from tests._runs import ROOT

    def run(name, *extra):
        result = subprocess.run(
            [sys.executable, "examples/fabric_train.py", "--ckpt", str(tmp_path / name),
             "--model", "gpt2", "--n_layer", "4", "--batch_size", "8", "--seq_len", "256",
             "--corpus_chars", "300000", "--log_every", "5", "--save_every", "100", "--steps",
             "20", "--fresh", "--devices", "2", "--strategy", "ddp", *extra],
            cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        losses = [float(v) for v in re.findall(r"^step +\d+ \| loss ([\d.]+)", result.stdout, re.M)]
        return result.stdout + result.stderr, losses

    out, graphed = run("graphs.ckpt")
    assert "CUDA graphs: a graph per block" in out and "4 blocks captured as a graph each" in out
    out, eager = run("eager.ckpt", "--no_cuda_graphs")
    assert "CUDA graphs: off (--no_cuda_graphs)" in out and "captured" not in out
    worst = max(abs(a - b) / b for a, b in zip(graphed, eager))
    print(f"\n[Fabric DDP graphs vs eager] {graphed} vs {eager}, worst relative gap {worst:.4f}")
    assert len(graphed) == 4 and worst < 0.02


@needs_te
def test_a_users_model_under_ddp_replays_its_blocks_with_cached_fp8_weights_and_learns(tmp_path):
    """``examples/own_model.py --devices 2 --recipe delayed``: the plugin converts the user's
    plain ``torch.nn`` GPT on each rank, captures each block as its own CUDA graph (DDP's
    all-reduce between the replays) whose FP8 weights are cast once per optimizer step, FP8 is
    verified, and the loss falls well below uniform (ln 512 = 6.24), as on one GPU."""
    import os
    import subprocess
    import sys

    from tests._runs import ROOT

    # the example as a user runs it, with the package's INFO log shown (Lightning's DDP launcher
    # starts this same script again for rank 1)
    script = tmp_path / "run_example.py"
    script.write_text(
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s: %(message)s')\n"
        "from examples import own_model\n"
        "own_model.main(sys.argv[1:])\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}  # examples/ as a package
    result = subprocess.run(
        [sys.executable, str(script), "--devices", "2", "--recipe", "delayed", "--steps", "40",
         "--batch_size", "16"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "blocks captured, a graph each" in out and \
        "FP8 weights cast once per optimizer step" in out, out[-4000:]
    finals = [float(v) for v in re.findall(r"precision: FP8 delayed; .*final train loss ([\d.]+)",
                                           out)]
    print(f"\n[own model DDP 2 GPUs] final losses per rank {finals}")
    assert len(finals) == 2 and max(finals) < 6.0, out[-4000:]


# examples/hf_llama.py's model: a Hugging Face Llama, hidden 1024, 4 decoder layers (random)
HF_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 8192,
            "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
            "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 2048,
            "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


@needs_te
def test_a_users_hugging_face_llama_trains_fp8_under_fsdp2_resumes_and_exports(tmp_path):
    """``examples/hf_llama.py --devices 2 --strategy fsdp --recipe delayed``: the memory check,
    FSDP2Strategy sharding the Llama's decoder layers, every projection swapped for te.Linear
    and verified FP8, finite falling losses; a second run resumes from the sharded checkpoint and
    exports a directory ``transformers`` loads, which has learned. (CPU, gloo, the plugin's
    fallback: tests/test_hf_fsdp2.py.)"""
    import json
    import math
    import subprocess
    import sys

    import transformers

    from examples.hf_llama import learnable_tokens
    from tests._runs import ROOT

    (tmp_path / "config.json").write_text(json.dumps(HF_LLAMA))

    def run(*args):
        result = subprocess.run(
            [sys.executable, "examples/hf_llama.py", "--config_json", str(tmp_path / "config.json"),
             "--devices", "2", "--strategy", "fsdp", "--recipe", "delayed", "--batch_size", "4",
             "--seq_len", "512", "--lr", "1e-3", *args],
            cwd=ROOT, capture_output=True, text=True, timeout=600)
        out = result.stdout + result.stderr
        assert result.returncode == 0, out[-4000:]
        (status, step, losses), = re.findall(r"precision: (.*); steps (\d+); losses: ([\d. ]+)",
                                             out)
        return out, status, int(step), [float(v) for v in losses.split()]

    ckpt, hf = tmp_path / "last.ckpt", tmp_path / "hf"
    out, status, step, losses = run("--steps", "30", "--ckpt", str(ckpt))
    assert status == "FP8 delayed" and step == 30 and len(losses) == 30, out[-4000:]
    assert "memory: estimated" in out and "FSDP2: 4 blocks in" in out, out[-4000:]
    # q, k, v, o, gate, up and down of each of the 4 layers swapped for te.Linear and run FP8
    assert "FP8 verified: 28 te modules ran FP8 in the first step" in out, out[-4000:]
    start = sum(losses[:5]) / 5
    assert all(math.isfinite(v) for v in losses) and sum(losses[-5:]) / 5 < start - 0.5, losses
    assert (ckpt / "meta.pt").is_file() and len(list(ckpt.glob("*.distcp"))) == 2

    out, status, step, resumed = run("--steps", "40", "--resume", str(ckpt), "--export", str(hf))
    assert status == "FP8 delayed" and step == 40 and len(resumed) == 10, out[-4000:]
    assert "Restored all states from the checkpoint" in out, out[-4000:]
    assert all(math.isfinite(v) for v in resumed) and max(resumed) < start - 0.5  # went on

    model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    batch = learnable_tokens(HF_LLAMA["vocab_size"], 2, 128)
    with torch.no_grad():
        loss = float(model(batch, labels=batch).loss)
    print(f"\n[HF Llama FSDP2 2 GPUs] losses {losses[0]:.3f} -> {losses[-1]:.3f}, resumed "
          f"{resumed[0]:.3f} -> {resumed[-1]:.3f}; the export on the CPU {loss:.3f}")
    assert model.config.num_hidden_layers == 4 and loss < start - 0.5
