"""GPU: FP8 on models this package did not build, on both engines (tests/fp8/test_any_model.py
holds the CPU side): a user's plain ``torch.nn`` GPT (``examples/own_model.py``) and a Hugging Face
``LlamaForCausalLM`` inside a user's ``LightningModule`` train FP8 under ``FP8Precision``, keep the
model's own state-dict keys, and resume from their checkpoints with their scaling state."""

import importlib

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from fp8_lightning import Speedups
from fp8_lightning.fp8 import FP8Precision

pytestmark = pytest.mark.gpu  # skipped without CUDA and TE (tests/conftest.py)

B, T, VOCAB = 16, 64, 512


def example():
    return importlib.import_module("examples.own_model")


class LitLlama(L.LightningModule):
    """A user's LightningModule around a Hugging Face Llama built from a local directory."""

    def __init__(self, directory, use_cache=None) -> None:
        super().__init__()
        import transformers

        self.model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
        self.use_cache = use_cache  # None: the model config's (on)

    def training_step(self, batch, batch_idx):
        logits = self.model(batch[:, :-1], use_cache=self.use_cache).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fp8_modules(arch, recipe="delayed", fuse_mlp=True):
    """The GEMM modules the policy runs FP8 (the LM head stays BF16): the example's four linears
    a block, its MLP's two as one te.LayerNormMLP where TE fuses them (``fuse_mlp``, on by
    default); Llama's seven a block (its SwiGLU MLP is not a LayerNorm -> GELU chain)."""
    if arch == "llama":
        return 2 * 7
    return 4 * 3 if recipe == "delayed" and fuse_mlp else 4 * 4


def build(arch, tmp_path, use_cache=None):
    """(a fresh LightningModule, the number of its linears the policy runs FP8)."""
    torch.manual_seed(0)
    if arch == "nanogpt":
        return example().LitNanoGPT(vocab_size=VOCAB, block_size=T, n_layer=4, n_head=4,
                                    n_embd=128), 4 * 4
    transformers = pytest.importorskip("transformers")
    directory = tmp_path / "hf-llama"
    if not directory.exists():
        transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T)
        ).save_pretrained(directory)
    return LitLlama(str(directory), use_cache), 2 * 7  # q, k, v, o, gate, up, down a block


def fit(module, steps, tmp_path, recipe, ckpt_path=None, callbacks=(), accumulate_grad_batches=1,
        bf16_first_layers=0, **speedups):
    """``speedups``: Speedups' options (the converter every run here has, its defaults unless
    given)."""
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, VOCAB, (B * 40, 1), generator=g)
    data = (starts + 7 * torch.arange(T + 1)) % VOCAB  # each token + 7: learnable
    plugin = FP8Precision(recipe=recipe, fp8_layers="all", on_unavailable="error",
                          bf16_first_layers=bf16_first_layers, converter=Speedups(**speedups))
    trainer = L.Trainer(max_steps=steps, plugins=[plugin], accelerator="gpu", devices=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=1.0,
                        default_root_dir=tmp_path, callbacks=list(callbacks),
                        accumulate_grad_batches=accumulate_grad_batches)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=B), ckpt_path=ckpt_path)
    return trainer, plugin


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
@pytest.mark.parametrize("arch", ["nanogpt", "llama"])
def test_a_users_model_trains_fp8_and_resumes_with_its_scaling_state(arch, recipe, tmp_path,
                                                                      caplog):
    module, _ = build(arch, tmp_path)
    n_gemms = fp8_modules(arch, recipe)
    plain_keys = set(module.state_dict())
    first = "transformer.h.0.c_attn" if arch == "nanogpt" else "model.layers.0.self_attn.q_proj"
    weight = module.model.get_submodule(first).weight
    trainer, plugin = fit(module, 30, tmp_path, recipe)
    assert plugin.fp8_active and plugin.status == f"FP8 {recipe}", plugin.reason
    assert plugin.bf16_modules == {"lm_head": "fp8_lm_head=false"}
    assert len(plugin.engine.modules_ran(plugin.model)) == n_gemms
    swapped = module.model.get_submodule(first)
    assert swapped.weight is weight  # the user's own parameter, in a te.Linear or in place
    assert type(swapped).__module__.startswith("transformer_engine") == (recipe == "delayed")
    # what the swapped TE modules measured over compiled BF16: a TE recipe says so
    warned = "runs this model's nn.Linear layers as TE modules" in caplog.text
    assert warned == (recipe == "delayed")
    assert float(trainer.callback_metrics["train/loss"]) < 5.0  # uniform: ln 512 = 6.24
    # the checkpoint holds the user's model's keys exactly, loadable without FP8 (strict)
    ckpt = tmp_path / f"{arch}-{recipe}.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)
    assert set(saved["state_dict"]) == plain_keys
    fresh, _ = build(arch, tmp_path)
    fresh.load_state_dict(saved["state_dict"])  # strict, plain nn.Linear
    # resumed under FP8: the scaling state comes back (delayed scaling's amax history)
    resumed_module, _ = build(arch, tmp_path)
    resumed, plugin2 = fit(resumed_module, 35, tmp_path, recipe, ckpt_path=ckpt)
    assert resumed.global_step == 35 and plugin2.fp8_active
    if recipe == "delayed":
        assert plugin2.scaling_restored == n_gemms
    for a, b in zip(module.model.state_dict().values(), fresh.model.state_dict().values()):
        assert torch.equal(a.cpu(), b.cpu())


def test_the_examples_layernorms_run_inside_the_gemm_module_after_them():
    """TE delayed on the example's blocks: ln_1 -> c_attn and ln_2 -> c_fc become one
    te.LayerNormLinear each (the norm an identity holding its own parameters), the other linears
    te.Linear; the state dict keeps the user's keys, and with FP8 off the logits are the plain
    model's within BF16 rounding."""
    import copy

    from fp8_lightning.fp8 import build_recipe_config, get_engine
    from fp8_lightning.fp8.norm_fusion import FusedNorm

    torch.manual_seed(0)
    model = example().NanoGPT(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=4,
                              n_embd=128).cuda()
    twin = copy.deepcopy(model)
    engine = get_engine("te")
    engine.convert(model, build_recipe_config("delayed"), {"lm_head": "fp8_lm_head=false"})
    for block in model.transformer.h:
        assert type(block.c_attn).__name__ == type(block.c_fc).__name__ == "LayerNormLinear"
        assert type(block.c_proj).__name__ == type(block.mlp_proj).__name__ == "Linear"
        assert isinstance(block.ln_1, FusedNorm) and isinstance(block.ln_2, FusedNorm)
        assert block.c_attn.layer_norm_weight is block.ln_1.weight
        assert block.c_fc.layer_norm_bias is block.ln_2.bias
    assert list(model.state_dict()) == list(twin.state_dict())
    model.load_state_dict(twin.state_dict())  # strict: a plain model's checkpoint loads
    idx = torch.randint(0, VOCAB, (2, T), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        with engine.context(False):
            fused = model(idx).float()
        plain = twin(idx).float()
    assert (fused - plain).abs().max() < 0.05 * plain.abs().max(), (fused - plain).abs().max()
    with torch.autocast("cuda", dtype=torch.bfloat16), engine.context(True):
        model(idx).float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert len(engine.modules_ran(model)) == 8


@pytest.mark.parametrize("arch", ["nanogpt", "llama"])
def test_a_users_blocks_replay_as_cuda_graphs_and_train_as_they_do_eagerly(arch, tmp_path):
    """TE delayed: each block of the user's model is captured at the second step and replayed
    from then on; it trains to the loss of the same run without graphs (the same kernels), with
    FP8 verified."""
    losses = {}
    for graphs in (False, True):
        module, _ = build(arch, tmp_path, use_cache=False)
        trainer, plugin = fit(module, 30, tmp_path, "delayed", cuda_graphs=graphs)
        losses[graphs] = float(trainer.callback_metrics["train/loss"])
        assert plugin.fp8_active and len(plugin.engine.modules_ran(plugin.model)) \
            == fp8_modules(arch)
    assert plugin.converter.graphs.compiled  # compile_blocks' default on one GPU
    assert plugin.converter.graphs.status == "ready"
    blocks = plugin.converter.graphs.blocks
    assert plugin.converter.graphs.replays == 29 * len(blocks)  # every step's blocks after the first
    # released with the fit (the plugin's teardown): the blocks' own forward, no graph memory
    assert all("forward" not in block.__dict__ for block in blocks) and not plugin.converter.graphs.live
    assert losses[True] < 5.0 and abs(losses[True] - losses[False]) < 0.02 * losses[False], losses


def test_two_forwards_before_one_backward_replay_once_and_train_as_without_graphs(tmp_path):
    """A training step that calls the model twice before its backward (a batch in two halves):
    each block's first call replays, the second runs eagerly (the graph's buffers still hold the
    first call's activations), and the run trains to the loss it reaches without graphs."""
    own = example()

    class LitTwice(own.LitNanoGPT):
        def training_step(self, batch, batch_idx):
            loss = sum(F.cross_entropy(self.model(half[:, :-1]).flatten(0, 1).float(),
                                       half[:, 1:].flatten()) for half in batch.chunk(2)) / 2
            self.log("train/loss", loss)
            return loss

    losses = {}
    for graphs in (False, True):
        torch.manual_seed(0)
        module = LitTwice(vocab_size=VOCAB, block_size=T, n_layer=4, n_head=4, n_embd=128)
        trainer, plugin = fit(module, 30, tmp_path, "delayed", cuda_graphs=graphs)
        losses[graphs] = float(trainer.callback_metrics["train/loss"])
    assert plugin.converter.graphs.status == "ready" and plugin.converter.graphs.replays == 29 * 4
    assert losses[True] < 5.0 and abs(losses[True] - losses[False]) < 0.02 * losses[False], losses


def test_a_block_the_policy_keeps_bf16_runs_eagerly_and_the_others_replay(tmp_path, caplog):
    """bf16_first_layers=1: the first block's call runs outside FP8 (the policy's hooks), so it
    is not captured (a graph captured in FP8 would never replay); the other three replay."""
    module, _ = build("nanogpt", tmp_path)
    with caplog.at_level("INFO", logger="fp8_lightning.own_model_graphs"):
        trainer, plugin = fit(module, 30, tmp_path, "delayed", bf16_first_layers=1)
    assert plugin.fp8_active and plugin.converter.graphs.status == "ready"
    assert "3 of the model's 4 blocks captured" in caplog.text
    assert plugin.converter.graphs.replays == 29 * 3
    assert float(trainer.callback_metrics["train/loss"]) < 5.0


def test_a_hugging_face_model_with_its_cache_on_trains_eagerly_and_says_why(tmp_path):
    module, _ = build("llama", tmp_path)  # use_cache: the config's (on), as a user leaves it
    trainer, plugin = fit(module, 3, tmp_path, "delayed")
    assert plugin.fp8_active and trainer.global_step == 3
    assert plugin.converter.graphs.status.startswith("off: block 0's call cannot be replayed")
    assert "use_cache=False" in plugin.converter.graphs.status


class StepKernels(L.Callback):
    """The names of the GPU kernels of one training step (the third)."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 2:
            self.profiler.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 2:
            torch.cuda.synchronize()
            self.profiler.stop()
            self.names = {e.name for e in self.profiler.events()
                          if e.device_type.name == "CUDA"}


def test_a_users_attention_runs_cudnns_kernels_on_hopper(tmp_path):
    """The user's F.scaled_dot_product_attention under the plugin runs cuDNN's kernels on
    Hopper, forward and backward, whether PyTorch's order put it first or the plugin did."""
    if torch.cuda.get_device_capability() != (9, 0) or torch.backends.cudnn.version() <= 91500:
        pytest.skip("the plugin puts cuDNN first on Hopper with cuDNN newer than 9.15.0 only")
    module, _ = build("nanogpt", tmp_path)
    kernels = StepKernels()
    fit(module, 4, tmp_path, "delayed", cuda_graphs=False, callbacks=[kernels])
    cudnn = [name for name in kernels.names if name.startswith("cudnn") and "sdpa" in name]
    assert any("fprop" in name for name in cudnn) and any("bprop" in name for name in cudnn), \
        sorted(kernels.names)
    assert not any("pytorch_flash" in name for name in kernels.names)


class GradIsMainGrad(L.Callback):
    """Before each optimizer step: is every swapped layer's .grad its FP32 main_grad?"""

    def __init__(self) -> None:
        self.seen: list[bool] = []
        self.fused = 0  # the plugin's fused weights (it lets them go at the fit's end)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        wgrad = trainer.precision_plugin.converter.wgrad
        self.fused = len(wgrad.weights) if wgrad is not None else 0
        self.seen.append(wgrad is not None and all(
            w.grad is w.main_grad and w.grad.dtype == torch.float32 for w in wgrad.weights))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_fused_weight_gradients_train_as_te_s_own_with_and_without_graphs(tmp_path, accumulate):
    """fuse_wgrad_accumulation: each swapped layer's wgrad GEMM sums into FP32 main_grad, its
    .grad; with the blocks replayed as CUDA graphs too, and over accumulated micro-batches, the
    run trains to the loss of the same run without it."""
    losses = {}
    for fused, graphs in ((False, False), (True, False), (True, True)):
        module, n_linears = build("nanogpt", tmp_path)
        check = GradIsMainGrad()
        trainer, plugin = fit(module, 30, tmp_path, "delayed", cuda_graphs=graphs,
                              callbacks=[check], fuse_wgrad_accumulation=fused,
                              accumulate_grad_batches=accumulate)
        losses[fused, graphs] = float(trainer.callback_metrics["train/loss"])
        assert plugin.fp8_active and len(plugin.engine.modules_ran(plugin.model)) \
            == fp8_modules("nanogpt")
        if fused:  # a weight each linear: te.LayerNormMLP holds fc1's and fc2's
            assert check.seen and all(check.seen) and check.fused == n_linears
        if graphs:
            assert plugin.converter.graphs.status == "ready" and plugin.converter.graphs.cache_weights
            # each block's FP8 weights cast at a step's first micro-batch only (its weights
            # changed), the cast reused by the others: one replay in `accumulate` casts
            replays, casts, n = plugin.converter.graphs.replays, plugin.converter.graphs.recasts, len(
                plugin.converter.graphs.blocks)
            assert abs(accumulate * casts - replays) <= accumulate * n, (replays, casts)
    eager = losses[False, False]
    assert eager < 5.0 and all(abs(v - eager) < 0.02 * eager for v in losses.values()), losses


def test_cached_fp8_weights_follow_a_fused_optimizer_across_accumulated_micro_batches(tmp_path):
    """A fused AdamW writes the weights without moving their version counters: its step still
    has the graphs cast each block's FP8 weights again at the next step's first micro-batch
    (with stale casts the blocks would not learn), and the run trains to the loss of the same
    run without graphs."""
    losses = {}
    for graphs in (False, True):
        module, _ = build("nanogpt", tmp_path)
        module.configure_optimizers = lambda m=module: torch.optim.AdamW(
            m.parameters(), lr=m.hparams.lr, fused=True)
        trainer, plugin = fit(module, 30, tmp_path, "delayed", cuda_graphs=graphs,
                              accumulate_grad_batches=2)
        losses[graphs] = float(trainer.callback_metrics["train/loss"])
        assert plugin.fp8_active, plugin.reason
    assert plugin.converter.graphs.status == "ready" and plugin.converter.graphs.cache_weights
    replays, casts, n = plugin.converter.graphs.replays, plugin.converter.graphs.recasts, len(plugin.converter.graphs.blocks)
    assert abs(2 * casts - replays) <= 2 * n, (replays, casts)
    eager = losses[False]
    assert eager < 5.0 and abs(losses[True] - eager) < 0.02 * eager, losses


def test_fuse_mlp_runs_the_examples_mlps_as_te_layernorm_mlp_and_trains_as_without(tmp_path):
    """fuse_mlp: the example's ln_2 -> c_fc -> GELU(tanh) -> mlp_proj becomes one
    te.LayerNormMLP per block holding the user's parameters (ln_1 -> c_attn still one
    te.LayerNormLinear), FP8 verified, FP32 weight gradients into fc1's and fc2's main_grad, the
    blocks replayed as CUDA graphs; it trains to the loss of the run without it, its checkpoint
    has the user's keys and resumes with its scaling state."""
    losses, keys = {}, {}
    for fused in (False, True):
        module, _ = build("nanogpt", tmp_path)
        user_keys = list(module.state_dict())
        check = GradIsMainGrad()
        trainer, plugin = fit(module, 30, tmp_path, "delayed", callbacks=[check],
                              fuse_mlp=fused)
        losses[fused] = float(trainer.callback_metrics["train/loss"])
        assert plugin.fp8_active and plugin.converter.graphs.status == "ready", plugin.reason
        assert check.seen and all(check.seen)
        keys[fused] = list(module.state_dict())
        assert keys[fused] == user_keys
        if fused:
            block = module.model.transformer.h[0]
            assert type(block.c_fc).__name__ == "LayerNormMLP"
            assert type(block.c_attn).__name__ == "LayerNormLinear"
            assert block.c_fc.fc2_weight is block.mlp_proj.weight
            assert len(plugin.engine.modules_ran(plugin.model)) == 4 * 3  # c_attn, c_proj, MLP
            assert check.fused == 4 * 4  # c_attn, c_proj, fc1, fc2 weights
            ckpt = tmp_path / "fused.ckpt"
            trainer.save_checkpoint(ckpt)
            resumed, _ = build("nanogpt", tmp_path)
            trainer2, plugin2 = fit(resumed, 32, tmp_path, "delayed", ckpt_path=str(ckpt),
                                    fuse_mlp=True)
            assert plugin2.fp8_active and trainer2.global_step == 32
            assert plugin2.scaling_restored == 4 * 3  # the LayerNormMLPs' two GEMMs' scales too
    assert losses[False] < 5.0 and abs(losses[True] - losses[False]) < 0.02 * losses[False], losses


@pytest.mark.parametrize("arch", ["nanogpt", "llama"])
def test_compile_blocks_captures_compiled_blocks_that_train_as_the_eager_ones(arch, tmp_path,
                                                                              caplog):
    """compile_blocks: each block's forward is captured torch.compile'd around its te.Linear
    layers (the capture did not fall back to the block's own forward), and the run trains to the
    loss of the run whose graphs hold the blocks' own forward."""
    losses = {}
    for compiled in (False, True):
        module, _ = build(arch, tmp_path, use_cache=False)
        with caplog.at_level("INFO", logger="fp8_lightning.own_model_graphs"):
            trainer, plugin = fit(module, 30, tmp_path, "delayed", compile_blocks=compiled)
        losses[compiled] = float(trainer.callback_metrics["train/loss"])
        assert plugin.fp8_active and len(plugin.engine.modules_ran(plugin.model)) \
            == fp8_modules(arch)
        assert plugin.converter.graphs.status == "ready" and plugin.converter.graphs.compiled == compiled, caplog.text
    assert "compiled capture failed" not in caplog.text
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # Dynamo compiled them
    eager = losses[False]
    assert eager < 5.0 and abs(losses[True] - eager) < 0.02 * eager, losses


def test_the_example_trains_fp8_under_the_plugin():
    """examples/own_model.py as a user runs it, on an FP8 GPU: FP8 verified after the first
    step, the LM head BF16, the loss falls. One GPU: on several, Lightning's DDP launcher would
    start pytest again for the other ranks."""
    run = example().main(["--steps", "30", "--batch_size", "16", "--recipe", "delayed",
                          "--devices", "1"])
    plugin = run["plugin"]
    assert plugin.fp8_active and plugin.status == "FP8 delayed", plugin.reason
    assert plugin.bf16_modules.get("lm_head") == "fp8_lm_head=false"
    assert len(plugin.engine.modules_ran(plugin.model)) == fp8_modules("nanogpt")
    assert float(run["trainer"].callback_metrics["train/loss"]) < 6.0  # below uniform: ln 512 = 6.24
