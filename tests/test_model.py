import math

import pytest
import torch
import torch.nn.functional as F

from fp8_lightning.config import GPTConfig
from fp8_lightning.model import GPT, compile_model, next_token_loss, uncompile_model

# Each preset family cut to CPU size (2 layers, narrow), keeping its architecture.
FAMILIES = {
    "gpt2": dict(n_layer=2, n_head=4, n_embd=64, ffn_hidden=256, block_size=64),
    "gpt2-xl": dict(n_layer=2, n_head=4, n_embd=64, ffn_hidden=256, block_size=64),
    "llama3-small": dict(n_layer=2, n_head=4, n_kv_heads=2, n_embd=64, ffn_hidden=160,
                         block_size=64, vocab_size=1000),
    "llama3-8b": dict(n_layer=2, n_head=8, n_kv_heads=2, n_embd=128, ffn_hidden=224,
                      block_size=64, vocab_size=1000, qk_norm=True),
    "tiny": {},
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_forward_backward_every_family(name):
    torch.manual_seed(0)
    config = GPTConfig.from_name(name, **FAMILIES[name])
    model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (2, 32))
    logits = model(idx)
    assert logits.shape == (2, 32, config.vocab_size)
    loss = F.cross_entropy(logits.flatten(0, 1), idx.roll(-1, 1).flatten())
    assert abs(loss.item() - math.log(config.vocab_size)) < 0.5  # ~uniform at init
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n


def test_llama_family_has_no_biases_and_swiglu_doubles_fc1():
    c = GPTConfig.from_name("tiny-llama")
    model = GPT(c)
    names = dict(model.named_parameters())
    assert not any(n.endswith("bias") for n in names)
    assert names["blocks.0.mlp.fc1_weight"].shape == (2 * c.ffn_hidden, c.n_embd)
    assert names["blocks.0.qkv.weight"].shape == ((c.n_head + 2 * c.n_kv_heads) * c.head_dim, c.n_embd)
    assert "wpe.weight" not in names and "lm_head.weight" in names


def test_gpt2_initialisation():
    torch.manual_seed(0)
    c = GPTConfig.from_name("gpt2", n_layer=4, n_embd=256, n_head=4, ffn_hidden=1024)
    model = GPT(c)
    p = dict(model.named_parameters())
    assert p["blocks.0.qkv.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert p["blocks.0.mlp.fc1_weight"].std().item() == pytest.approx(0.02, rel=0.05)
    expected = 0.02 / math.sqrt(2 * c.n_layer)
    assert p["blocks.3.proj.weight"].std().item() == pytest.approx(expected, rel=0.05)
    assert p["blocks.3.mlp.fc2_weight"].std().item() == pytest.approx(expected, rel=0.05)
    assert torch.all(p["blocks.0.qkv.bias"] == 0) and torch.all(p["norm_f.weight"] == 1)
    assert model.lm_head.weight is model.wte.weight  # GPT-2 ties embedding and head


def test_padded_vocab_takes_no_probability_mass():
    torch.manual_seed(0)
    c = GPTConfig.from_name("tiny")
    model = GPT(c)
    with torch.no_grad():  # make the padded rows of the head win every argmax if they could
        model.lm_head.weight[c.vocab_size:] = 10.0
    idx = torch.randint(0, c.vocab_size, (2, 16))
    logits = model(idx)
    assert logits.shape[-1] == c.vocab_size == 50257
    F.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
    assert torch.all(model.lm_head.weight.grad[c.vocab_size:] == 0)  # padding gets no gradient
    out = model.generate(idx[:, :4], max_new_tokens=8, temperature=1.0, top_k=50)
    assert out.shape == (2, 12) and int(out.max()) < c.vocab_size
    greedy = model.generate(idx[:, :4], max_new_tokens=4, temperature=0)
    assert int(greedy.max()) < c.vocab_size


def test_generate_samples_only_ids_the_tokenizer_can_decode():
    # A Llama-sized head trained on GPT-2 tokens: ids past the tokenizer's vocabulary never come out
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=1000))
    with torch.no_grad():  # ids >= 100 win every draw if they can
        model.norm_f.bias.fill_(1.0)
        model.lm_head.weight[100:] = 10.0
    idx = torch.randint(0, 100, (2, 4))
    assert bool((model.generate(idx, 4, temperature=0)[:, 4:] >= 100).all())  # the head alone
    assert int(model.generate(idx, 8, top_k=50, vocab_size=100).max()) < 100
    assert int(model.generate(idx, 4, temperature=0, vocab_size=100).max()) < 100


def test_rope_model_is_causal():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny-llama")).eval()
    idx = torch.randint(0, 1000, (1, 20))
    changed = idx.clone()
    changed[0, 15] = (changed[0, 15] + 1) % 1000
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :15], b[:, :15])
    assert not torch.allclose(a[:, 15:], b[:, 15:])


def test_too_long_sequence_is_a_clear_error():
    model = GPT(GPTConfig.from_name("tiny"))
    with pytest.raises(ValueError, match="exceeds block_size=128"):
        model(torch.zeros(1, 129, dtype=torch.long))


def test_checkpoint_round_trip_strict():
    a, b = GPT(GPTConfig.from_name("tiny")), GPT(GPTConfig.from_name("tiny"))
    b.load_state_dict(a.state_dict(), strict=True)
    idx = torch.randint(0, 50257, (1, 8))
    torch.testing.assert_close(a(idx), b(idx))


def _reference_loss(logits, targets, vocab_size):
    return F.cross_entropy(logits[..., :vocab_size].float().flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_next_token_loss_is_cross_entropy_over_the_real_vocabulary(compiled):
    torch.manual_seed(0)
    vocab, padded = 1000, 1024
    logits = torch.randn(2, 16, padded, dtype=torch.bfloat16, requires_grad=True)
    logits.data[..., vocab:] = 30.0  # the padded columns would win every softmax if they counted
    targets = torch.randint(0, vocab, (2, 16))
    loss_fn = torch.compile(next_token_loss) if compiled else next_token_loss
    loss = loss_fn(logits, targets, vocab)
    (grad,) = torch.autograd.grad(loss, logits)
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = _reference_loss(ref_logits, targets, vocab)
    (ref_grad,) = torch.autograd.grad(ref, ref_logits)
    assert loss.dtype == torch.float32 and torch.allclose(loss, ref, rtol=1e-5)
    assert torch.allclose(grad.float(), ref_grad.float(), atol=1e-6)
    assert torch.all(grad[..., vocab:] == 0)  # padding takes no probability mass, no gradient


def test_model_returns_the_loss_given_targets():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny"))
    idx = torch.randint(0, 50257, (2, 17))
    logits = model(idx[:, :-1])
    assert torch.allclose(model(idx[:, :-1], idx[:, 1:]), _reference_loss(logits, idx[:, 1:], 50257))


def test_compiled_regions_keep_names_and_compile_each_region_once():
    """compile_model's TE-backend path (the regions between TE modules) on the PyTorch layers:
    same parameters and losses as eager, one graph for all blocks' attention and one for the loss."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    config = GPTConfig(name="tiny-llama", n_layer=3)  # RoPE and QK-norm inside the region
    model = GPT(config)
    names = [n for n, _ in model.named_parameters()]
    idx = torch.randint(0, config.vocab_size, (2, 33))
    eager = model(idx[:, :-1], idx[:, 1:])
    torch._dynamo.reset()
    counters.clear()
    model.backend = "te"  # take the TE-backend path; its layers are the PyTorch twins here
    assert "heads + SDPA" in compile_model(model)
    compiled = model(idx[:, :-1], idx[:, 1:])
    compiled.backward()
    assert [n for n, _ in model.named_parameters()] == names
    assert torch.allclose(compiled, eager, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 2  # the 3 blocks share one compiled region
    assert model.generate(idx[:, :5], 3).shape == (2, 8)  # sampling runs eagerly, any length
    uncompile_model(model)
    assert torch.allclose(model(idx[:, :-1], idx[:, 1:]), eager, rtol=1e-5)
    torch._dynamo.reset()


def test_blocks_compiled_one_by_one_keep_names_and_share_one_graph():
    """compile_model(per_block=True), the PyTorch backend's layout for a CUDA graph per block
    under DDP: the same losses and gradients as eager, every block the same compiled code."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    config = GPTConfig(name="tiny", n_layer=2)
    model = GPT(config)
    names = [n for n, _ in model.named_parameters()]
    idx = torch.randint(0, config.vocab_size, (2, 17))
    eager = model(idx[:, :-1], idx[:, 1:])
    eager.backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    counters.clear()
    assert compile_model(model, per_block=True) == "each block and the loss"
    compiled = model(idx[:, :-1], idx[:, 1:])
    compiled.backward()
    assert [n for n, _ in model.named_parameters()] == names
    assert torch.allclose(compiled, eager, rtol=1e-5)
    assert all(torch.allclose(p.grad, g, rtol=1e-4, atol=1e-6)
               for p, g in zip(model.parameters(), eager_grads))
    assert counters["stats"]["unique_graphs"] == 2  # both blocks one region, and the loss
    uncompile_model(model)
    assert all("residual" not in block.__dict__ for block in model.blocks)
    torch._dynamo.reset()


def test_blocks_compiled_one_by_one_stay_whole_inside_ddp(tmp_path):
    """Called inside DDP's forward, a block compiled for its own CUDA graph is one compiled graph,
    not DDP's bucket-sized pieces (Dynamo's DDPOptimizer), at any bucket size."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/pg")
    try:
        torch.manual_seed(0)
        config = GPTConfig(name="tiny", n_layer=2, n_embd=256, n_head=4)  # 3 MB a block
        model = GPT(config)
        torch._dynamo.reset()
        counters.clear()
        compile_model(model, per_block=True)
        ddp = DistributedDataParallel(model, bucket_cap_mb=1)  # buckets of a third of a block
        idx = torch.randint(0, config.vocab_size, (2, 17))
        ddp(idx[:, :-1], idx[:, 1:]).backward()
        # one graph for both blocks, one for the loss; split, a block's would be several
        assert counters["aot_autograd"]["total"] == 2, dict(counters["aot_autograd"])
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_residual_stream_dtype_follows_fp32_residual():
    """Under BF16 autocast the residual stream stays float32 on the torch backend (nanoGPT's
    behaviour, the baseline's) unless ``fp32_residual=False``, which carries it in BF16 (the TE
    backend's default) through every block; without autocast it is the weights' dtype."""
    idx = torch.randint(0, 64, (2, 8))
    seen = {}
    for fp32 in (None, False):
        model = GPT(GPTConfig(name="tiny", vocab_size=64, fp32_residual=fp32))
        assert model.fp32_residual is (fp32 is None)
        dtypes = []
        model.blocks[-1].register_forward_hook(lambda m, args, out: dtypes.append(out.dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x, _ = model.embed(idx)
            loss = model(idx, idx)
        loss.backward()
        assert torch.isfinite(loss) and model.wte.weight.grad is not None
        seen[fp32] = (x.dtype, dtypes[0])
        assert model.embed(idx)[0].dtype == torch.float32  # no autocast: the weights' dtype
    assert seen == {None: (torch.float32, torch.float32), False: (torch.bfloat16, torch.bfloat16)}


# ------------------------------------------------------------------ activation checkpointing
def _loss_and_grads(config: GPTConfig, idx: torch.Tensor, **checkpointing):
    torch.manual_seed(0)
    model = GPT(config, **checkpointing)
    saved = []  # bytes autograd keeps for the backward during this forward

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(idx, idx)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, sum(saved)


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
@pytest.mark.parametrize("mode,every", [("full", 1), ("full", 2), ("mlp", 1), ("mlp", 2)])
def test_activation_checkpointing_gives_the_same_gradients_and_keeps_less(name, mode, every):
    config = GPTConfig.from_name(name, n_layer=4)
    idx = torch.randint(0, config.vocab_size, (2, 32))
    loss, grads, kept = _loss_and_grads(config, idx)
    ckpt_loss, ckpt_grads, ckpt_kept = _loss_and_grads(
        config, idx, activation_checkpointing=mode, activation_checkpointing_every=every)
    assert ckpt_loss == loss
    for n, g in grads.items():
        torch.testing.assert_close(ckpt_grads[n], g, rtol=0, atol=0, msg=n)
    assert ckpt_kept < kept, (mode, every, ckpt_kept, kept)


def test_full_checkpointing_keeps_less_than_mlp_and_every_block_less_than_every_other():
    config = GPTConfig.from_name("tiny-llama", n_layer=4)
    idx = torch.randint(0, config.vocab_size, (2, 32))
    kept = {(mode, every): _loss_and_grads(config, idx, activation_checkpointing=mode,
                                           activation_checkpointing_every=every)[2]
            for mode, every in [("full", 1), ("full", 2), ("mlp", 1)]}
    assert kept["full", 1] < kept["full", 2] and kept["full", 1] < kept["mlp", 1], kept


def test_activation_checkpointing_is_validated():
    with pytest.raises(ValueError, match="activation_checkpointing='some'"):
        GPT(GPTConfig.from_name("tiny"), activation_checkpointing="some")
    with pytest.raises(ValueError, match="activation_checkpointing_every=0"):
        GPT(GPTConfig.from_name("tiny"), activation_checkpointing="full",
            activation_checkpointing_every=0)


def test_full_checkpointing_wraps_each_blocks_inner_forward(monkeypatch):
    """The recomputed region is the block's own forward (``Block.residual``), called from inside
    ``Block.forward``: hooks on the block (FSDP2's gather and input cast) stay outside it. (PyTorch
    < 2.13 skips FSDP2's cast when it recomputes a checkpointed FSDP2 module: pytorch#159359.)"""
    import fp8_lightning.model as model_module

    wrapped = []
    real = model_module.checkpoint

    def spy(backend, function, *args):
        wrapped.append(function)
        return real(backend, function, *args)

    monkeypatch.setattr(model_module, "checkpoint", spy)
    model = GPT(GPTConfig(name="tiny", n_layer=2, vocab_size=512), activation_checkpointing="full")
    idx = torch.randint(0, 512, (1, 9))
    model(idx[:, :-1], idx[:, 1:]).backward()
    assert [f.__func__ for f in wrapped] == [model_module.Block.residual] * 2
    assert [f.__self__ for f in wrapped] == list(model.blocks)
