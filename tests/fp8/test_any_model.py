"""FP8 for a model this package did not build: a nanoGPT-style GPT of plain ``torch.nn``
(``examples/own_model.py``) under the same layer policy and the torchao engine, whose float8
GEMMs run on a CPU too (``torch._scaled_mm`` has a CPU kernel). The TE engine's swap of
``nn.Linear`` for ``te.Linear`` needs a GPU (tests/test_gpu_any_model.py)."""

import importlib

import pytest
import torch
from torch import nn

from fp8_lightning.fp8 import bf16_module_names, build_recipe_config, get_engine
from fp8_lightning.fp8.policy import find_blocks, find_lm_head

torchao = pytest.importorskip("torchao")


def example():
    return importlib.import_module("examples.own_model")


def pair():
    """The example's model twice, the same weights: one to convert, one BF16 reference."""
    own = example()
    torch.manual_seed(0)
    model = own.NanoGPT(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=128)
    twin = own.NanoGPT(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=128)
    twin.load_state_dict(model.state_dict())
    return model, twin


def test_the_policy_finds_a_users_blocks_and_lm_head():
    model, _ = pair()
    assert find_blocks(model) == ("transformer.h", 4) and find_lm_head(model) == "lm_head"
    engine = get_engine("torchao")
    gemms = engine.gemm_modules(model)
    assert len(gemms) == 4 * 4 + 1  # four nn.Linear a block and the head
    keep = bf16_module_names(model, gemms, fp8_lm_head=False, bf16_first_layers=1,
                             bf16_last_layers=1)
    assert keep == {"transformer.h.0": "bf16_first_layers=1", "transformer.h.3": "bf16_last_layers=1",
                    "lm_head": "fp8_lm_head=false"}
    odd = nn.Sequential(nn.Linear(64, 40), nn.Linear(40, 64))  # 40: not a multiple of 16
    assert bf16_module_names(odd, engine.gemm_modules(odd), fp8_lm_head=False,
                             bf16_first_layers=0, bf16_last_layers=0) == {
        "0": "GEMM dims not multiples of 16", "1": "GEMM dims not multiples of 16"}


def test_a_users_linears_run_float8_switch_back_and_keep_their_checkpoints():
    model, twin = pair()
    engine = get_engine("torchao")
    keep = {"lm_head": "fp8_lm_head=false"}
    engine.convert(model, build_recipe_config("tensorwise"), keep)
    assert len(engine.modules_ran(model)) == 16 and "lm_head" not in engine.modules_ran(model)
    idx = torch.randint(0, 512, (2, 32))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fp8 = model(idx).float().logsumexp(-1).mean()
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_mm") == 16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = twin(idx).float().logsumexp(-1).mean()
    assert fp8.item() != bf16.item() and abs(fp8.item() - bf16.item()) < 0.05 * abs(bf16.item())
    fp8.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    # the BF16 fallback: F.linear again, the twin's numbers
    engine.set_enabled(model, False)
    assert engine.modules_ran(model) == []
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert torch.equal(model(idx), twin(idx))
    # the same module types and plain tensors under the same names: checkpoints load either way
    assert [type(m) for m in model.modules()] == [type(m) for m in twin.modules()]
    state = model.state_dict()
    assert state.keys() == twin.state_dict().keys()
    assert all(type(v) is torch.Tensor for v in state.values())



def test_a_models_blocks_are_its_largest_list_not_a_blocks_experts():
    """A mixture-of-experts block holds a longer list (its experts) than the model's list of
    blocks: the blocks are the list with the most parameters (the layer policy's first and last
    layers, FSDP2's units and the block graphs all follow it)."""
    class MoEBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.Linear(32, 32)
            self.experts = nn.ModuleList(nn.Linear(32, 32) for _ in range(8))

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, 32)
            self.layers = nn.ModuleList(MoEBlock() for _ in range(2))

    assert find_blocks(MoE()) == ("layers", 2)
    assert find_blocks(nn.Linear(2, 2)) == ("", 0)

@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_the_example_trains_under_the_plugin_and_says_what_ran(recipe):
    """On this CPU the plugin falls back (no FP8 GPU) and says why, on either engine; on an FP8
    GPU the same script trains FP8 (tests/test_gpu_any_model.py)."""
    run = example().main(["--steps", "6", "--batch_size", "4", "--recipe", recipe])
    plugin, trainer = run["plugin"], run["trainer"]
    assert trainer.global_step == 6
    assert not plugin.fp8_active and plugin.status.split(" ")[1] == "(fallback:", plugin.status
    assert torch.isfinite(torch.tensor(float(trainer.callback_metrics["train/loss"])))
    # nothing was swapped: the user's own modules, as they wrote them
    assert all(type(m).__module__.startswith("torch.") for m in run["module"].model.modules()
               if not type(m).__name__ in ("NanoGPT", "Block"))


@pytest.mark.parametrize("devices", ["0", "two", "-1"])
def test_the_example_refuses_a_devices_value_in_one_line(devices, capsys):
    with pytest.raises(SystemExit) as exit:
        example().main(["--devices", devices])
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"error: --devices must be a positive count or auto (got {devices!r})")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_hugging_face_model_runs_float8_through_the_same_path(arch):
    """``LlamaForCausalLM`` (``nn.Linear``) and ``GPT2LMHeadModel`` (Hugging Face's ``Conv1D``,
    weights stored (in, out)): the policy finds ``model.layers`` / ``transformer.h`` and
    ``lm_head``, every block GEMM runs float8, and the logits stay close to BF16's."""
    import copy

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
        blocks, per_block = "model.layers", 7  # q, k, v, o, gate, up, down
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4))
        blocks, per_block = "transformer.h", 4  # c_attn, c_proj, c_fc, mlp.c_proj
    model.eval()
    twin = copy.deepcopy(model)
    assert find_blocks(model) == (blocks, 2) and find_lm_head(model) == "lm_head"
    engine = get_engine("torchao")
    gemms = engine.gemm_modules(model)
    keep = bf16_module_names(model, gemms, fp8_lm_head=False, bf16_first_layers=0,
                             bf16_last_layers=0)
    assert keep == {"lm_head": "fp8_lm_head=false"}  # every block GEMM's dims are multiples of 16
    engine.convert(model, build_recipe_config("tensorwise"), keep)
    assert len(engine.modules_ran(model)) == 2 * per_block
    idx = torch.randint(0, 1000, (2, 32))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fp8 = model(idx).logits.float()
        bf16 = twin(idx).logits.float()
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_mm") == 2 * per_block
    assert not torch.equal(fp8, bf16)
    assert (fp8 - bf16).abs().mean() < 0.1 * bf16.abs().mean()
    copied = copy.deepcopy(model)  # a copy's routed GEMMs use the copy's own weights
    with torch.no_grad():
        next(p for n, p in copied.named_parameters() if n.endswith("0.mlp.c_fc.weight")
             or n.endswith("0.mlp.up_proj.weight")).zero_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(model(idx).logits.float(), fp8)  # the original is untouched
            assert not torch.equal(copied(idx).logits.float(), fp8)  # the copy runs its own


def test_the_te_engine_says_which_users_models_it_cannot_swap(tmp_path):
    """The TE engine swaps nn.Linear for te.Linear (on a GPU); the models that swap cannot serve
    get a reason, which the plugin's fallback logs (torchao converts them in place)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    transformers = pytest.importorskip("transformers")
    te = get_engine("te")
    model, _ = pair()
    assert te.cannot_convert(model) is None
    assert len(te.gemm_modules(model)) == 4 * 4 + 1  # the user's nn.Linear layers, the head too
    # what swapped TE modules measured over the model's compiled BF16: the plugin says so
    assert "engine='torchao' compiles the whole model" in te.speed_note(model, {})
    assert get_engine("torchao").speed_note(model, {}) is None
    # nothing to say where the policy keeps every nn.Linear BF16 (nothing is swapped)
    assert te.speed_note(model, {name: "kept" for name in te.gemm_modules(model)}) is None
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4))
    assert "Conv1D" in te.cannot_convert(gpt2)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    assert te.cannot_convert(llama) is None
    llama.gradient_checkpointing_enable()
    assert "gradient checkpointing" in te.cannot_convert(llama)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        assert "sharded (FSDP2)" in te.cannot_convert(model)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("argv", [["--recipe", "bogus"], ["--steps", "0"], ["--batch_size", "-1"]])
def test_the_example_refuses_bad_arguments_with_one_error_line(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        example().main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and ": error: " in err[-1] and \
        "Traceback" not in "\n".join(err)
