"""FSDP2 on several CPU processes (gloo): through the CLI and configs/fsdp.yaml (the layout it
picks, sharded checkpoints, their consolidation and conversion), where FSDP2Strategy builds the
model, and per-block gradients against one process's (activation checkpointing, blocks grouped in
one unit).

The fits train on a small vocabulary (the ``small_vocab`` fixture) and without loader workers
(``fit_ranks``): the point is the processes, not the tokenizer or the data loader's processes."""

from pathlib import Path
from typing import Any

import pytest
import torch

from fp8_lightning.checkpoint_files import (CheckpointError, consolidate_checkpoint, list_checkpoints,
                                      load_checkpoint_file)
from fp8_lightning.cli import main
from fp8_lightning.module import GPTLightningModule
from tests._runs import TOKENS_PER_STEP, fit_ranks, rank_settings, run_main


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory, small_vocab):
    root = tmp_path_factory.mktemp("fsdp")
    # With activation checkpointing (the 8B configs' memory lever) in the first run only: the
    # recompute runs inside FSDP2's per-block unshard, and the checkpoint does not depend on it.
    # keep_last 1: the sharded step-3 copy is rotated out when step 6's is written
    first = fit_ranks(root, small_vocab, "--trainer.max_steps", "6",
                      "--model.activation_checkpointing", "full",
                      "--trainer.callbacks.init_args.keep_last", "1", config="configs/fsdp.yaml")
    (root / "after6").mkdir()
    for name in (".metadata", "meta.pt"):  # the step-6 checkpoint's index, for the checks below
        (root / "after6" / name).write_bytes((root / "checkpoints/last.ckpt" / name).read_bytes())
    second = fit_ranks(root, small_vocab, "--trainer.max_steps", "9", "--ckpt_path", "last",
                       "--trainer.callbacks+=tests.helpers.StrategySettings",
                       "--trainer.callbacks.path", str(root / "settings"),
                       config="configs/fsdp.yaml")
    return root, first, second


def test_fsdp2_groups_small_blocks_in_one_unit_keeps_the_root_and_gathers_bf16(fsdp_runs):
    """configs/fsdp.yaml on every rank, its layout chosen: the tiny model's blocks (far below
    UNIT_PARAMS) sharded as one unit, whose weights backward needs first and so are not freed
    after forward, the root's kept for the backward too, BF16 gathers where the run's weights are
    bf16-mixed (fp32 on this CPU: the policy follows the precision that runs)."""
    root, _, _ = fsdp_runs
    ranks = rank_settings(root)
    assert len(ranks) == 2 and ranks[0] == ranks[1]
    blocks, root_unit = ranks[0]["blocks"], ranks[0]["root"]
    assert ranks[0]["strategy"] == "fsdp2" and len(blocks) == 2 and ranks[0]["units"] == 1
    assert not any(b["reshard_after_forward"] for b in blocks)
    assert not root_unit["reshard_after_forward"]
    assert len({b["param_dtype"] for b in blocks + [root_unit]}) == 1


def built_on(device, config):
    """Where FSDP2Strategy's init context, on ``device``, puts a tensor built for ``config``."""
    from fp8_lightning.distributed import FSDP2Strategy

    strategy = FSDP2Strategy()
    strategy.parallel_devices = [torch.device(device)]
    strategy.connect(GPTLightningModule(config))
    with strategy.tensor_init_context():
        built = torch.empty(1).device.type
    with strategy.tensor_init_context(empty_init=True):
        assert torch.empty(1).is_meta  # asked for the meta device: Lightning's way
    return built


def test_fsdp2_builds_on_the_cpu_when_its_device_is_the_cpu():
    """(On a GPU the model builds there: test_gpu_fast_path.)"""
    from fp8_lightning.config import GPTConfig

    assert built_on("cpu", GPTConfig.from_name("gpt2")) == "cpu"


def test_fsdp2_layout_follows_the_settings_and_the_memory_estimate():
    """FSDP2Strategy's layout: given settings as given; otherwise weights kept gathered only when
    the run fits one GPU unsharded (not when it does not, nor when unknown), and blocks grouped
    into units of about UNIT_PARAMS parameters (GPT-2 124M: one unit, 1.3B: 4 blocks a unit,
    Llama-3-8B: a block a unit)."""
    from fp8_lightning.config import GPTConfig
    from fp8_lightning.distributed import fsdp2_layout
    from fp8_lightning.model import GPT

    with torch.device("meta"):  # the real shapes, no memory
        gpt2, big, llama = (GPT(GPTConfig.from_name(name), backend="torch")
                            for name in ("gpt2", "gpt-1.3b", "llama3-8b"))
    assert fsdp2_layout(gpt2, True, 1, True)[:2] == (True, 1)
    assert fsdp2_layout(gpt2, None, None, True)[:2] == (False, 12)
    assert fsdp2_layout(gpt2, None, None, False)[0] is True
    assert fsdp2_layout(gpt2, None, None, None)[0] is True
    assert fsdp2_layout(big, None, None, True)[1] == 4
    assert fsdp2_layout(llama, None, None, False)[:2] == (True, 1)
    assert "12 blocks in 1 unit(s)" in fsdp2_layout(gpt2, None, None, True)[2]


def test_the_fsdp2_plan_per_model_size_and_engine(monkeypatch):
    """What FSDP2 does with each model the package ships, decided before the first step: units
    of about UNIT_PARAMS (the 3B-class preset: 2 blocks a unit), the PyTorch backend's blocks
    compiled one by one before sharding (BF16 and torchao) while TE's blocks stay eager with
    only the loss compiled, and float8 all-gather where the engine has it (torchao tensorwise)."""
    from fp8_lightning import fast_path
    from fp8_lightning.config import GPTConfig
    from fp8_lightning.distributed import fsdp2_layout
    from fp8_lightning.fp8 import FP8Precision
    from fp8_lightning.model import GPT

    monkeypatch.setattr(fast_path, "compile_status", lambda device: (True, "works"))
    with torch.device("meta"):
        models = {name: GPT(GPTConfig.from_name(name), backend="torch")
                  for name in ("gpt2", "gpt-1.3b", "llama3.2-3b", "llama3-8b")}
    per_unit = {name: fsdp2_layout(gpt, None, None, False)[1] for name, gpt in models.items()}
    assert per_unit == {"gpt2": 12, "gpt-1.3b": 4, "llama3.2-3b": 2, "llama3-8b": 1}
    for backend, per_block, regions in (("torch", True, True), ("te", False, False)):
        path = fast_path.plan_compile(None, "cuda", backend, sharded=True)
        assert path.compile and path.per_block == per_block and path.regions == regions
    assert FP8Precision(recipe="tensorwise").gathers_float8
    assert not any(FP8Precision(recipe=r).gathers_float8 for r in ("delayed", "rowwise", "current"))


def test_fsdp2_on_a_run_that_fits_one_gpu_points_to_ddp():
    """The FSDP2 strategy's advice: DDP where the memory estimate says the run fits one GPU
    unsharded; nothing where it does not, or where nothing was estimated (no GPU)."""
    from fp8_lightning.distributed import ddp_hint

    assert "configs/ddp.yaml" in ddp_hint(True)
    assert ddp_hint(False) is None and ddp_hint(None) is None


def test_fsdp_checkpoint_is_a_directory_of_shards_that_lists_and_resumes(fsdp_runs):
    root, first, second = fsdp_runs
    last = root / "checkpoints" / "last.ckpt"
    assert last.is_dir()
    assert sorted(p.name for p in last.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                      "meta.pt"]
    assert not [p for p in last.parent.iterdir() if p.name.startswith(".")]  # no temporaries
    assert "data: resumed at block" in second and "(verified)" in second
    assert "Restored all states from the checkpoint" in second
    assert "activation checkpointing: full, 2 of 2 blocks" in first
    rows = {r["file"]: r for r in list_checkpoints(str(root / "checkpoints"))}
    assert rows["last.ckpt/"]["step"] == 9 and rows["last.ckpt/"]["tokens"] == 9 * TOKENS_PER_STEP * 2
    assert rows["last.ckpt/"]["size"] > 1e6


def test_fsdp_keep_last_rotates_sharded_checkpoint_directories(fsdp_runs):
    """Checkpoint(keep_last=1) under FSDP2: each last.ckpt directory is kept as a step-N copy
    (links to its shards), the older copy removed, and the copy survives last.ckpt's replacement
    by the resumed run (step 9) with the step-6 state."""
    root, first, _ = fsdp_runs
    ckpts = root / "checkpoints"
    kept = sorted(p.name for p in ckpts.glob("step-*.ckpt"))
    assert kept == ["step-0000006.ckpt"], (kept, first[-2000:])
    copy = ckpts / "step-0000006.ckpt"
    assert copy.is_dir() and sorted(p.name for p in copy.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    rows = {r["file"]: r for r in list_checkpoints(str(ckpts))}
    assert rows["step-0000006.ckpt/"]["step"] == 6 and rows["last.ckpt/"]["step"] == 9


def test_fsdp_checkpoint_consolidates_to_one_file_that_loads_and_resumes_on_one_process(
        fsdp_runs, small_vocab, tmp_path, capsys):
    root, _, _ = fsdp_runs
    out = tmp_path / "one.ckpt"
    main(["consolidate", str(root / "checkpoints" / "last.ckpt"), str(out)])  # (in this process)
    ckpt = load_checkpoint_file(out)
    # Full tensors under the single-GPU names, loadable into a plain (unsharded) module ...
    module = GPTLightningModule(config=ckpt["hyper_parameters"]["config"], backend="torch",
                                lr_decay_steps=100)
    module.configure_model()
    module.load_state_dict(ckpt["state_dict"])
    # ... and optimizer state that maps onto the same parameters (by position, like Lightning).
    optimizer = module.configure_optimizers()["optimizer"]
    optimizer.load_state_dict(ckpt["optimizer_states"][0])
    for group in optimizer.param_groups:
        for p in group["params"]:
            assert optimizer.state[p]["exp_avg"].shape == p.shape
            assert int(optimizer.state[p]["step"]) == 9
    # One process, no strategy (this one: the checkpoint is under test, not the launch):
    # training continues from step 9 with that optimizer state.
    log = fit_ranks(tmp_path / "single", small_vocab, "--trainer.max_steps", "10",
                    "--ckpt_path", str(out), capsys=capsys)
    assert "Restored all states from the checkpoint" in log and "(verified)" in log
    # generate reads the sharded directory directly.
    capsys.readouterr()
    main(["generate", "--ckpt", str(root / "checkpoints" / "last.ckpt"), "--max_new_tokens", "4",
          "--prompt", "ROMEO:"])
    assert capsys.readouterr().out.startswith("ROMEO:")


def test_a_sharded_checkpoint_consolidates_on_the_cpu_whatever_the_default_device(fsdp_runs):
    """FSDP2Strategy builds (and so reads model.init_from) under its GPU as the default device;
    the consolidated checkpoint still lands on the CPU, not whole on every rank's GPU (here the
    meta device stands in for the GPU)."""
    from fp8_lightning.checkpoint_files import consolidate_checkpoint

    with torch.device("meta"):
        state = consolidate_checkpoint(fsdp_runs[0] / "checkpoints" / "last.ckpt")
    tensors = list(state["state_dict"].values())
    assert tensors and all(t.device.type == "cpu" for t in tensors)


def test_fsdp_sharded_checkpoint_converts_to_hugging_face(fsdp_runs, tmp_path):
    transformers = pytest.importorskip("transformers")
    from fp8_lightning.commands.generate import load_model
    from fp8_lightning.commands.convert import checkpoint_to_hf

    last = fsdp_runs[0] / "checkpoints" / "last.ckpt"
    out = checkpoint_to_hf(str(last), str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours = load_model(str(last), device="cpu", backend="torch")[0]
    idx = torch.randint(0, ours.config.vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx), atol=1e-4, rtol=0)


def test_fsdp_sharded_checkpoint_errors(fsdp_runs, tmp_path, capsys):
    root, _, _ = fsdp_runs
    torn = tmp_path / "torn.ckpt"
    torn.mkdir()
    (torn / "meta.pt").write_bytes((root / "after6" / "meta.pt").read_bytes())
    with pytest.raises(CheckpointError, match="without .metadata"):
        load_checkpoint_file(torn)
    (torn / ".metadata").write_bytes((root / "after6" / ".metadata").read_bytes())
    with pytest.raises(CheckpointError, match="shards could not be read"):
        consolidate_checkpoint(torn)  # the index is there, the shard files are not
    code, _, err = run_main(capsys, ["consolidate", str(root / "checkpoints" / "nope.ckpt")])
    assert code == 2 and "does not exist" in err
    code, _, err = run_main(capsys, ["consolidate", str(root / "checkpoints" / "last.ckpt"),
                                     str(tmp_path)])
    assert code == 2 and "is a directory; give a file name" in err


def sharded_grads(rank: int, port: int, out: str, modes: tuple, backend: str = "torch",
                  fp8: bool = False, also: tuple = (), **shard: Any) -> None:
    """One of two ranks (gloo on the CPU, NCCL on two GPUs): a tiny Llama sharded with FSDP2 per
    block as FSDP2Strategy shards it (BF16 gathers, fp32 reduction; ``shard``: more arguments of
    ``shard_model``), one step per activation-checkpointing mode under BF16 autocast (TE: FP8
    delayed scaling with ``fp8``); rank 0 saves each mode's loss and full gradients. ``also``:
    more ``(modes, shard)`` layouts, run the same way in the same processes (one launch), their
    results saved after the first's, in a list."""
    import contextlib
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from fp8_lightning.config import GPTConfig
    from fp8_lightning.distributed import gather_policy, shard_model
    from fp8_lightning.model import GPT

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = "cuda" if backend == "te" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=2)
    mesh = init_device_mesh(device, (2,))
    idx = torch.randint(0, 512, (4, 65), generator=torch.Generator().manual_seed(rank)).to(device)

    def fp8_context():
        if not fp8:
            return contextlib.nullcontext()
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import DelayedScaling

        return te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling())

    layouts = [(modes, shard), *also]
    results = [{} for _ in layouts]
    runs = [(mode, layout, result) for (layout_modes, layout), result in zip(layouts, results)
            for mode in layout_modes]
    for mode, shard, result in runs:  # (shard: this layout's)
        torch.manual_seed(0)
        # 16-aligned GEMM dims, as FP8 needs
        config = GPTConfig(name="tiny-llama", n_layer=2, n_embd=128, ffn_hidden=256,
                           block_size=64, vocab_size=512)
        model = GPT(config, backend=backend, activation_checkpointing=mode).to(device)
        shard_model(model, mesh, mp_policy=gather_policy("bf16-mixed"), **shard)
        # FP8: a second pass over the same batch, compared there. The first pass's delayed-scaling
        # update between forward and backward changes the scales TE's MLP recompute (mlp) uses.
        for _ in range(2 if fp8 else 1):
            model.zero_grad()
            with torch.autocast(device, dtype=torch.bfloat16), fp8_context():
                loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
        result[mode] = {"loss": loss.detach().cpu(),
                        **{n: p.grad.full_tensor().cpu() for n, p in model.named_parameters()}}
    if rank == 0:
        torch.save(results if also else results[0], out)
    # both ranks past their last collective before gloo's threads go: one rank tearing down
    # while the other still ran one aborted it once ("terminate called without an active
    # exception", SIGABRT) in a CPU suite run
    dist.barrier()
    dist.destroy_process_group()


def run_two_ranks(tmp_path, modes, **kwargs) -> dict:
    """:func:`sharded_grads` on two spawned ranks; rank 0's results (with ``also``: a list, one
    per layout)."""
    import tempfile
    import functools

    import torch.multiprocessing as mp

    from tests._runs import free_port

    port = free_port()
    out = Path(tempfile.mkdtemp(dir=tmp_path)) / "grads.pt"
    mp.start_processes(functools.partial(sharded_grads, **kwargs), args=(port, str(out), modes),
                       nprocs=2, start_method="spawn")
    return torch.load(out)


@pytest.fixture(scope="module")
def two_rank_grads(tmp_path_factory) -> tuple:
    """:func:`sharded_grads` on two gloo ranks (one launch for both layouts): a block a unit,
    each block freed after forward (modes none, full, mlp); and both blocks in one unit, kept
    gathered between forward and backward (modes none, full)."""
    return tuple(run_two_ranks(tmp_path_factory.mktemp("grads"), ("none", "full", "mlp"),
                               also=((("none", "full"), dict(blocks_per_unit=2,
                                                              reshard_after_forward=False)),)))


@pytest.fixture(scope="module")
def per_block_grads(two_rank_grads) -> dict:
    """:func:`sharded_grads` on two gloo ranks, a block a unit, each block freed after forward."""
    return two_rank_grads[0]


def test_activation_checkpointing_under_fsdp2_on_two_ranks_gives_the_same_gradients(
        per_block_grads):
    """Recomputing a sharded block in the backward (full, mlp) reproduces the gradients of no
    checkpointing exactly, on the PyTorch backend over two gloo ranks."""
    grads = per_block_grads
    assert len(grads["none"]) > 10
    for mode in ("full", "mlp"):
        for name, grad in grads["none"].items():
            assert torch.equal(grads[mode][name], grad), (mode, name)


def test_blocks_grouped_in_one_fsdp2_unit_and_kept_gathered_give_the_same_gradients(
        two_rank_grads):
    """FSDP2Strategy(blocks_per_unit, reshard_after_forward=False): both blocks gathered and
    reduced as one unit and not freed between forward and backward change when the collectives
    run, not what they compute: the same loss and gradients, exactly (two gloo ranks), with and
    without activation checkpointing."""
    per_block, grouped = two_rank_grads
    assert grouped.keys() == {"none", "full"}
    for mode in ("none", "full"):
        assert per_block[mode].keys() == grouped[mode].keys()
        for name, value in per_block[mode].items():
            assert torch.equal(grouped[mode][name], value), (mode, name)


def test_a_units_later_blocks_get_their_floating_inputs_cast_as_its_first():
    """The pre-hook shard_model puts on a unit's later blocks (PyTorch before #180428 casts the
    first block's inputs only): floating tensors to the gather dtype, others as they are; nothing
    done (None) when every input already has it."""
    from fp8_lightning.distributed import _cast_floating_inputs

    x, cos, ids = torch.ones(2, 3), torch.ones(3, dtype=torch.float64), torch.arange(3)
    args, kwargs = _cast_floating_inputs(torch.bfloat16, None, (x, cos, ids), {"s": torch.ones(1)})
    assert [a.dtype for a in args] == [torch.bfloat16, torch.bfloat16, torch.int64]
    assert kwargs["s"].dtype == torch.bfloat16
    assert _cast_floating_inputs(torch.bfloat16, None, (x.bfloat16(), ids), {}) is None
