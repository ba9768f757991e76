"""A user's Hugging Face Llama (``examples/hf_llama.py``) under ``FSDP2Strategy`` on two CPU
processes (gloo): its decoder layers are FSDP2's units, a sharded checkpoint resumes with the
same losses as the run that was not stopped, and the exported directory loads with
``transformers`` and has the checkpoint's weights; what FSDP2Strategy says where it cannot shard
a model. FP8 on two GPUs: tests/test_gpu_ddp.py.

The precision is ``FP8Precision(recipe="delayed")``'s fallback (no TE here), as configs/fsdp.yaml
runs in tests/test_fsdp2.py: the strategy takes the TE engine's path (the conversion before the
sharding), which falls back. The two ranks fork from one fresh process that has imported what
they need, as tests/test_hsdp.py's four do."""

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from fp8_lightning.config import ConfigError
from fp8_lightning.distributed import fsdp2_units
from fp8_lightning.fp8.engine import Engine
from fp8_lightning.fp8.policy import runs_bf16

transformers = pytest.importorskip("transformers")

STEPS, SAVE_AT, BATCH, T = 4, 1, 2, 32  # resumed with more steps left than were run


def tiny_config() -> dict:
    """tests/_hf.py's tiny Llama (GQA, untied head, Llama 3's RoPE base) as a config dict."""
    from tests._hf import TINY

    return TINY["llama"]().config.to_dict()


def _seen(record: dict, key: str, save: Path = None):
    """A callback recording into ``record[key]`` what a rank's fit had: its FSDP2 units, the
    weights it started from and each step's; it saves a sharded checkpoint to ``save`` after
    step ``SAVE_AT``."""
    import lightning as L
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from fp8_lightning.distributed import full_tensor

    def weights(module):  # under the checkpoint's names (no checkpoint wrapper's)
        return {n.replace("._checkpoint_wrapped_module", ""): full_tensor(p.detach()).clone()
                for n, p in module.model.named_parameters()}

    class Seen(L.Callback):
        def on_train_start(self, trainer, module):
            layers = list(module.model.model.layers)
            record[key] = {
                "layers": [(isinstance(layer, FSDPModule),
                            all(isinstance(p, DTensor) for p in layer.parameters()))
                           for layer in layers],
                "root": isinstance(module.model, FSDPModule),
                "start_step": trainer.global_step, "weights": {trainer.global_step: weights(module)},
                "precision": trainer.precision_plugin.status,
                "events": [h["event"] for h in trainer.precision_plugin.history]}

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            record[key]["weights"][trainer.global_step] = weights(module)
            if save is not None and trainer.global_step == SAVE_AT:
                trainer.save_checkpoint(save)

    return Seen()


def hf_rank(rank: int, port: int, root: str) -> None:
    """One of two ranks (torchrun's environment): the example's Llama trained STEPS steps under
    FSDP2Strategy, a sharded checkpoint saved after step SAVE_AT; a second fit resumed from it
    to STEPS, its checkpoint saved and the model exported; what each saw into ``rank<N>.pt``."""
    import lightning as L
    import torch.distributed as dist

    from examples.hf_llama import LitLlama
    from fp8_lightning import FSDP2Strategy
    from fp8_lightning.fp8 import FP8Precision

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
                      TORCHELASTIC_RUN_ID="hf-fsdp2-test")
    record, root = {}, Path(root)
    config = tiny_config()
    def fit(key, ckpt=None, save=None):
        torch.manual_seed(0)
        module = LitLlama(config, lr=1e-2, batch_size=BATCH, seq_len=T)
        trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=2,
                            strategy=FSDP2Strategy(process_group_backend="gloo",
                                                   blocks_per_unit=1),
                            plugins=[FP8Precision(recipe="delayed")], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, gradient_clip_val=1.0,
                            callbacks=[_seen(record, key, save)], default_root_dir=root)
        trainer.fit(module, ckpt_path=ckpt)  # the module's own rows: a resumed fit reads on
        record[key]["losses"] = [float(loss) for loss in module.losses]
        return module, trainer

    fit("first", save=root / f"step{SAVE_AT}.ckpt")
    module, trainer = fit("resumed", ckpt=root / f"step{SAVE_AT}.ckpt")
    trainer.save_checkpoint(root / "last.ckpt")
    module.export(str(root / "hf"))
    torch.save(record, root / f"rank{rank}.pt")
    dist.barrier()  # both ranks past their last collective before gloo's threads go
    dist.destroy_process_group()


class Swapped(nn.Linear):
    """:class:`SwapEngine`'s FP8 layer: records whether its weight was gathered when it ran."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.saw = type(self.weight).__name__  # "DTensor": FSDP2 gathered into another module
        return super().forward(x)


class SwapEngine(Engine):
    """A CPU stand-in for TE's engine (whose te.Linear needs a GPU): it swaps each ``nn.Linear``
    the policy runs FP8 for a module of another class holding the same parameters, as TE's does,
    so the test sees where FSDP2Strategy converts a model whose modules the engine replaces."""

    name, backend, swaps_modules = "te", "te", True

    def available(self, recipe):
        return True, "a CPU stand-in for TE's module swap"

    def gemm_modules(self, model):
        return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}

    def convert(self, model, config, bf16_modules, fuse_mlp=False):
        for name, old in self.gemm_modules(model).items():
            if type(old) is nn.Linear and not runs_bf16(name, bf16_modules):
                new = Swapped(old.in_features, old.out_features, bias=old.bias is not None,
                              device="meta")
                new.weight, new.bias = old.weight, old.bias
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, new)
        return []

    def modules_ran(self, model):
        return [n for n, m in model.named_modules() if getattr(m, "saw", None)]


def swap_rank(rank: int, port: int, root: str) -> None:
    """One of two ranks: the example's Llama under FSDP2Strategy and FP8Precision, TE's engine
    replaced by :class:`SwapEngine`; what each FP8 layer saw of its weight into ``swap<N>.pt``."""
    import lightning as L
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from examples.hf_llama import LitLlama
    from fp8_lightning import FSDP2Strategy
    from fp8_lightning.fp8 import FP8Precision, engine_registry

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
                      TORCHELASTIC_RUN_ID="hf-swap-test")
    engine_registry.ENGINE_CLASSES["te"] = SwapEngine
    torch.manual_seed(0)
    module = LitLlama(tiny_config(), lr=1e-2, batch_size=BATCH, seq_len=T)
    plugin = FP8Precision(recipe="delayed")
    trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=2, plugins=[plugin],
                        strategy=FSDP2Strategy(process_group_backend="gloo"), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=root)
    trainer.fit(module)
    swapped = {n: m for n, m in module.model.named_modules() if isinstance(m, Swapped)}
    torch.save({"status": plugin.status, "saw": {n: m.saw for n, m in swapped.items()},
                "sharded": all(isinstance(m.weight, DTensor) for m in swapped.values()),
                "head": type(module.model.lm_head).__name__},
               Path(root) / f"swap{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_a_model_whose_modules_fp8_replaces_is_converted_before_fsdp2_shards_it(tmp_path):
    """FSDP2 gathers each weight into the module that held it at ``fully_shard``: the layers FP8
    swaps in (TE's te.Linear; here a CPU stand-in) must be there before the sharding, and then
    run on gathered weights. Swapped after, they would see their DTensor shards."""
    from tests._runs import forked_ranks

    forked_ranks(swap_rank, 2, tmp_path, preload=("lightning.pytorch", "examples.hf_llama"))
    for rank in range(2):
        record = torch.load(tmp_path / f"swap{rank}.pt")
        assert record["status"] == "FP8 delayed"
        # q, k, v, o, gate, up, down of both layers; the LM head kept BF16 by the policy
        assert len(record["saw"]) == 2 * 7 and record["head"] == "Linear"
        assert set(record["saw"].values()) == {"Parameter"} and record["sharded"], record


@pytest.fixture(scope="module")
def hf_ranks(tmp_path_factory):
    """:func:`hf_rank` on two ranks; each rank's record, and the run directory."""
    from tests._runs import forked_ranks

    root = tmp_path_factory.mktemp("hf_fsdp2")
    forked_ranks(hf_rank, 2, root, preload=("lightning.pytorch", "examples.hf_llama"))
    return [torch.load(root / f"rank{r}.pt") for r in range(2)], root


def test_the_llamas_decoder_layers_are_the_fsdp2_units(hf_ranks):
    """Each decoder layer (in its checkpoint wrapper) is an FSDP2 unit whose parameters are
    DTensor shards, the LlamaForCausalLM the root unit, on both ranks; the plugin converted the
    model once, before the sharding (TE's path), and fell back there (no TE)."""
    records, _ = hf_ranks
    for record in records:
        for key in ("first", "resumed"):
            assert record[key]["layers"] == [(True, True)] * 2 and record[key]["root"]
        assert record["first"]["precision"].split(" ")[1] == "(fallback:"
        assert record["first"]["events"] == ["unavailable"]


def test_a_sharded_checkpoint_resumes_where_the_run_left_off(hf_ranks):
    """The fit resumed from the step-1 checkpoint (a directory of shards) starts from that step's
    weights and optimizer state, and reads on, for more steps than ran before it, from the rows
    step 2 read (every step reads other rows): its losses are those of the fit that went on,
    exactly."""
    records, root = hf_ranks
    assert sorted(p.name for p in (root / f"step{SAVE_AT}.ckpt").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    for record in records:
        first, resumed = record["first"], record["resumed"]
        assert len(first["losses"]) == STEPS and resumed["start_step"] == SAVE_AT
        assert first["losses"][-1] < first["losses"][0]
        saved = first["weights"][SAVE_AT]
        assert all(torch.equal(resumed["weights"][SAVE_AT][n], w) for n, w in saved.items())
        assert resumed["losses"] == first["losses"][SAVE_AT:]
    # each rank reads its own rows (the losses of a batch both ranks read would be equal)
    assert records[0]["first"]["losses"][0] != records[1]["first"]["losses"][0]


def test_the_export_loads_in_transformers_with_the_checkpoints_weights(hf_ranks):
    """The exported directory: ``AutoModelForCausalLM.from_pretrained`` loads it, with the
    weights of the trained model (the consolidated sharded checkpoint) and so the same logits."""
    from fp8_lightning.checkpoint_files import consolidate_checkpoint

    records, root = hf_ranks
    exported = transformers.AutoModelForCausalLM.from_pretrained(root / "hf").eval()
    state = consolidate_checkpoint(root / "last.ckpt")["state_dict"]
    trained = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(tiny_config()))
    trained.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    ends = records[0]["resumed"]["weights"][STEPS]
    assert all(torch.equal(trained.state_dict()[n], w) for n, w in ends.items())
    idx = torch.randint(0, 1000, (2, 16))
    with torch.no_grad():
        assert torch.equal(exported(idx).logits, trained.eval()(idx).logits)


class NoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))


class NoModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))


def test_fsdp2_units_are_the_models_blocks_or_one_line_saying_what_to_do(tmp_path):
    """The units of a user's Llama are its decoder layers (the root: the LlamaForCausalLM); a
    model without repeated blocks, or a module without ``self.model``, is one error line naming
    what to do instead; a model ``configure_model`` sharded itself has no units: left as it is."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from examples.hf_llama import LitLlama

    module = LitLlama(tiny_config(), activation_checkpointing=False)
    module.configure_model()
    model, blocks = fsdp2_units(module)
    assert model is module.model and blocks == list(module.model.model.layers)
    for bad, start in ((NoBlocks(), "NoBlocks.model (Sequential) has no repeated blocks (an "
                                    "nn.ModuleList of two or more) to shard as FSDP2 units: "),
                       (NoModel(), "NoModel has no `self.model` (an nn.Module) to shard: set it "
                                   "in configure_model, or ")):
        with pytest.raises(ConfigError) as error:
            fsdp2_units(bad)
        assert len(error.value.problems) == 1 and error.value.problems[0].startswith(start)
        assert "call torch.distributed.fsdp.fully_shard in configure_model" in str(error.value)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        for layer in module.model.model.layers:
            fully_shard(layer, mesh=init_device_mesh("cpu", (1,)))
        assert fsdp2_units(module) == (module.model, [])
    finally:
        dist.destroy_process_group()


def test_the_examples_presets_are_llama_shapes_and_its_command_line_is_checked(capsys, tmp_path):
    """docs/fp8.md's command parses; ``--preset`` builds a Llama 3.2 3B's and a Llama 3 8B's
    shapes (on the meta device here); a bad value is one ``error:`` line, exit status 2."""
    from examples.hf_llama import PRESETS, arguments

    args = arguments("--devices 4 --strategy fsdp --preset llama3-8b --steps 20 --ckpt "
                     "runs/llama/last.ckpt --export runs/llama/hf".split())
    assert (args.devices, args.strategy, args.preset, args.recipe) == ("4", "fsdp", "llama3-8b",
                                                                      "delayed")
    assert args.activation_checkpointing and args.export == "runs/llama/hf" and args.memory_check
    assert not arguments(["--no-memory_check"]).memory_check
    sizes = {}
    for name, config in PRESETS.items():
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(config))
        sizes[name] = (round(sum(p.numel() for p in model.parameters()) / 1e9, 2),
                       len(model.model.layers))
    assert sizes == {"llama3.2-3b": (3.21, 28), "llama3-8b": (8.03, 32)}
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny_config()))
    assert arguments(["--config_json", str(config)]).config == json.loads(config.read_text())
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    for argv, says in ((["--seq_len", "12"], "--seq_len"), (["--devices", "0"], "--devices"),
                       (["--preset", "llama3-70b"], "--preset"),
                       (["--config_json", str(tmp_path / "nope.json")], "nope.json"),
                       (["--config_json", str(tmp_path / "broken.json")], "broken.json"),
                       (["--config_json", str(tmp_path / "list.json")], "list.json"),
                       (["--resume", str(tmp_path / "none.ckpt")], "no such checkpoint")):
        with pytest.raises(SystemExit) as stop:
            arguments(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and ": error: " in err[-1] and says in err[-1], err
