"""Where a training step may replay CUDA graphs (the replays themselves need a GPU:
tests/test_gpu_fast_path.py and tests/test_gpu_engines.py run them)."""

import importlib

import pytest
import torch

from fp8_lightning.graphs import graphs_status


class FP8Stats:  # graphs_status knows the callback by its class name (no TE import needed)
    pass


@pytest.mark.parametrize("where, reason", [
    (dict(device_type="cpu", world_size=1), "CUDA graphs need a GPU"),
    (dict(device_type="cuda", world_size=2, sharded=True, callbacks=[FP8Stats()]), "FP8Stats"),
    (dict(device_type="cuda", world_size=1, callbacks=[FP8Stats()]), "FP8Stats"),
])
def test_graphs_stay_off_where_a_replay_would_skip_python_and_say_why(where, reason):
    ok, why = graphs_status(**where)
    assert not ok and reason in why


def test_one_gpu_replays_the_stack_ddp_a_graph_per_block_and_fsdp2_the_step():
    assert graphs_status("cuda", 1, [], sharded=False) == (True, "one GPU")
    # DDP's all-reduce runs in autograd hooks between the blocks' backward replays
    assert graphs_status("cuda", 2, [], sharded=False) == (True, "DDP, a graph per block")
    # FSDP2 frees and reallocates a block's gathered weights: its whole step is one graph
    ok, why = graphs_status("cuda", 2, [], sharded=True)
    assert ok and why.startswith("FSDP2, the whole step as one graph")


# ------------------------------------------------------------- another model's blocks (recorded)
import torch  # noqa: E402

from fp8_lightning.own_model_graphs import ModelBlockGraphs, _Call  # noqa: E402


class DynamicCache:  # what Hugging Face passes a decoder layer when use_cache is on
    pass


def llama_layer_call(T=16, use_cache=False):
    """A Hugging Face decoder layer's training call: the residual stream, RoPE tables, integer
    positions and fixed options."""
    x = torch.randn(2, T, 32, requires_grad=True)
    rope = (torch.randn(1, T, 8), torch.randn(1, T, 8))
    return (x,), dict(attention_mask=None, position_ids=torch.arange(T)[None],
                      position_embeddings=rope, use_cache=use_cache)


def test_a_block_call_is_replayed_only_when_its_tensors_and_options_are_the_recorded_ones():
    args, kwargs = llama_layer_call()
    call = _Call(args, kwargs)
    assert not call.unsupported
    assert call.fixed == {"attention_mask": None, "use_cache": False}
    assert set(call.tensor_kwargs) == {"position_ids", "position_embeddings"}
    assert call.matches(*llama_layer_call())  # new values, same layout
    assert not call.matches(*llama_layer_call(T=8))  # another sequence length
    assert not call.matches(*llama_layer_call(use_cache=True))  # another option
    args, kwargs = llama_layer_call()
    assert not call.matches(args, {k: v for k, v in kwargs.items() if k != "use_cache"})
    assert not call.matches((args[0].detach(),), kwargs)  # no gradient asked for the input
    # the capture's inputs: the recorded integer positions, random floats of the same layout
    (x,), sample = call.sample(torch.device("cpu"))
    assert x.shape == (2, 16, 32) and x.requires_grad
    assert torch.equal(sample["position_ids"], torch.arange(16)[None])
    assert [t.shape for t in sample["position_embeddings"]] == [(1, 16, 8), (1, 16, 8)]


def test_a_call_with_a_cache_object_cannot_be_replayed_and_says_what_to_change():
    args, kwargs = llama_layer_call()
    call = _Call(args, {**kwargs, "past_key_values": DynamicCache()})
    assert call.unsupported == ("its keyword 'past_key_values' is a DynamicCache (Hugging Face: "
                                "use_cache=False when training)")


def test_a_users_blocks_are_recorded_in_training_and_stay_eager_without_a_gpu():
    own = importlib.import_module("examples.own_model")
    torch.manual_seed(0)
    model = own.NanoGPT(vocab_size=128, block_size=16, n_layer=3, n_head=2, n_embd=32)
    idx = torch.randint(0, 128, (2, 16))
    graphs = ModelBlockGraphs(model.transformer.h)
    model.eval()
    with torch.no_grad():
        expected = model(idx)
    assert graphs.calls == {} and graphs.status == "recording"  # evaluation is not recorded
    model.train()
    model(idx)  # outside the plugin's training forward: not recorded either
    assert graphs.calls == {}
    with graphs.training_forward():
        model(idx)
    assert sorted(graphs.calls) == [0, 1, 2]
    # the residual stream, which carries the embeddings' gradient
    assert all(graphs.calls[i].args[0].key == ((2, 16, 32), torch.float32, True) for i in range(3))
    graphs.before_step()
    assert graphs.status == "off: CUDA graphs need a GPU"
    assert all(not block._forward_pre_hooks and "forward" not in block.__dict__
               for block in model.transformer.h)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(idx), expected)


def test_a_model_left_in_eval_mode_is_recorded_in_the_plugins_training_forward():
    """``from_pretrained`` leaves a Hugging Face model in ``eval()``, and Lightning trains it so
    (with a warning): its training forwards are recorded, with the mode, which a replay needs."""
    own = importlib.import_module("examples.own_model")
    model = own.NanoGPT(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32).eval()
    graphs = ModelBlockGraphs(model.transformer.h)
    with graphs.training_forward():
        model(torch.randint(0, 128, (2, 16)))
        with torch.no_grad():
            model.transformer.h[0](torch.randn(2, 16, 32))  # no gradient: not a training call
    assert sorted(graphs.calls) == [0, 1]
    assert not any(call.training for call in graphs.calls.values())
    assert graphs.calls[0].args[0].key[2]  # the recorded call is the one under grad


class TinyBlock(torch.nn.Module):  # importable, so that pickle can find it
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(32, 32)

    def forward(self, x):
        return x + self.fc(x)


def captured(block, x):
    """``block`` as a capture leaves it, with a stand-in for its graph (a real one needs a GPU)
    that answers "replayed"."""
    from fp8_lightning.own_model_graphs import _SLOT, _Call, _Replay, _captured_forward

    owner = ModelBlockGraphs([block])
    owner.remove()
    owner.fp8 = False  # captured outside FP8 autocast, as this CPU test runs
    block.__dict__[_SLOT] = _Replay(owner, 0, _Call((x,), {}), lambda *_: "replayed", block)
    block.forward = _captured_forward.__get__(block)
    owner.status, owner._fingerprint = "ready", owner._now()
    return owner


def test_a_copy_of_a_captured_block_runs_its_own_forward_with_its_own_weights():
    """A captured block holds its replay itself: a deep copy (an EMA of the model) or an
    unpickled block gets none and runs the class's forward with its own weights."""
    import copy
    import pickle

    torch.manual_seed(0)
    block = TinyBlock()
    x = torch.randn(2, 16, 32)
    owner = captured(block, x)
    with owner.training_forward():
        assert block(x) == "replayed"
    twin = copy.deepcopy(block)
    with torch.no_grad():
        next(twin.parameters()).add_(1.0)  # the copy's weights are its own
    with owner.training_forward():
        assert torch.equal(twin(x), type(twin).forward(twin, x))
    assert pickle.loads(pickle.dumps(block))(x).shape == x.shape


def test_a_replay_waits_for_its_backward_or_the_step_end_and_other_calls_run_eagerly(caplog):
    """The outputs of a replay are the graph's buffers: the next call runs eagerly until the
    replay's backward has run (here: nothing asks for a gradient, so until the optimizer step);
    a call of another shape runs eagerly and says so once; evaluation never replays."""
    torch.manual_seed(0)
    block = TinyBlock()
    x = torch.randn(2, 16, 32)
    owner = captured(block, x)
    assert isinstance(block(x), torch.Tensor)  # outside a training forward: never replayed
    with owner.training_forward():
        assert block(x) == "replayed"
        assert torch.equal(block(x), type(block).forward(block, x))  # the first's still live
        owner.step_end()
        with caplog.at_level("INFO", logger="fp8_lightning.own_model_graphs"):
            assert block(x) == "replayed"
            owner.step_end()
            assert isinstance(block(x[:, :8]), torch.Tensor)
            assert isinstance(block(x[:, :4]), torch.Tensor)
        assert caplog.text.count("other tensor shapes") == 1
        block.eval()  # another mode than the capture's
        assert isinstance(block(x), torch.Tensor)
    assert owner.replays == 2


@pytest.mark.parametrize("fused", [False, True])
def test_cached_fp8_weights_are_cast_at_a_steps_first_replay_and_reused_until_they_change(fused):
    """FP8 weight caching (TE's, delayed scaling): a replay asks the graph to cast the block's
    weights, TE's skip flag at 0, only when they may have changed since its last cast: after any
    torch.optim step (a fused AdamW writes the weights without moving their version counters)
    or another in-place change (a load); the step's other micro-batches reuse the cast, the
    flag at 1."""
    from fp8_lightning.own_model_graphs import _SLOT

    torch.manual_seed(0)
    block = TinyBlock()
    x = torch.randn(2, 16, 32)
    owner = captured(block, x)
    asked = []

    def graph(*args, is_first_microbatch):  # stands in for TE's graphed callable (a GPU's)
        asked.append((is_first_microbatch, float(owner._skip_flag)))
        return "replayed"

    block.__dict__[_SLOT].graphed = graph
    owner.cache_weights_on(torch.full((1,), -1.0))
    optimizer = torch.optim.AdamW(block.parameters(), fused=fused)

    def micro_batch():
        with owner.training_forward():
            assert block(x) == "replayed"
        owner.step_end()

    def optimizer_step():
        for p in block.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()

    micro_batch(), micro_batch()
    optimizer_step()
    micro_batch(), micro_batch()
    block.load_state_dict(TinyBlock().state_dict())  # outside a step: seen by its versions
    micro_batch(), micro_batch()
    assert asked == [(True, 0.0), (False, 1.0)] * 3
    assert owner.recasts == 3
    owner.remove()  # the optimizer hook goes with the graphs
    optimizer.step()
    assert owner._steps == 1


def test_a_captured_block_is_freed_with_its_model():
    """No registry outlives the model: a captured block, its replay and their owner go when the
    user drops them."""
    import gc
    import weakref

    block = TinyBlock()
    captured(block, torch.randn(2, 16, 32))
    gone = weakref.ref(block)
    del block
    gc.collect()
    assert gone() is None


def test_blocks_never_called_in_training_turn_the_graphs_off_and_say_which():
    """A model that skips some of its blocks (a layer drop) or compiles them: after a few
    training forwards without every block's call, the recording stops, with the reason."""
    own = importlib.import_module("examples.own_model")
    model = own.NanoGPT(vocab_size=128, block_size=16, n_layer=3, n_head=2, n_embd=32)
    graphs = ModelBlockGraphs(model.transformer.h)
    x = torch.randn(2, 16, 32)
    for _ in range(ModelBlockGraphs.WAIT + 1):
        graphs.before_step()
        with graphs.training_forward():
            model.transformer.h[0](x)  # blocks 1 and 2 never run
    assert graphs.status == "off: block(s) 1, 2 not called in 3 training forwards"
    assert all(not block._forward_pre_hooks for block in model.transformer.h)


def test_a_block_with_its_own_instance_forward_is_not_captured():
    """A wrapper on the instance (accelerate's hooks, a user's patch) would be skipped by a
    capture: the graphs stay off and say why, and the wrapper stays."""
    own = importlib.import_module("examples.own_model")
    model = own.NanoGPT(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32)
    wrapped = model.transformer.h[1]
    wrapper = wrapped.forward
    wrapped.forward = lambda *a, **k: wrapper(*a, **k)
    graphs = ModelBlockGraphs(model.transformer.h)
    with graphs.training_forward():
        model(torch.randint(0, 128, (2, 16)))
    graphs.before_step()
    assert graphs.status.startswith("off: block 1 has a forward of its own on the instance")
    assert "forward" in wrapped.__dict__


def test_graphs_captured_in_another_fp8_state_are_recorded_again_after_a_few_forwards(caplog):
    """Captured with FP8 on, then trained in BF16 (a fallback; here: this CPU's only state) for
    a few forwards: the blocks get their own forward back and their calls are recorded again,
    to be captured in the state training now runs in. One forward in another state does not."""
    block = TinyBlock()
    owner = captured(block, torch.randn(2, 16, 32))
    owner.fp8 = True
    owner.before_step()
    assert owner.status == "ready"
    with caplog.at_level("INFO", logger="fp8_lightning.own_model_graphs"):
        for _ in range(ModelBlockGraphs.WAIT - 1):
            owner.before_step()
    assert owner.status == "recording" and "forward" not in block.__dict__
    assert "FP8 off since the capture; recording its calls again" in caplog.text


def test_fp8_switched_between_recording_and_capture_records_again_then_gives_up(caplog):
    """The blocks' calls were recorded with FP8 on and the capture step runs with it off (a
    fallback in between): they are recorded again, to be captured in the state training runs in;
    a model whose blocks never run in the training step's FP8 state stops trying, and says so."""
    block = TinyBlock()
    graphs = ModelBlockGraphs([block])
    for attempt in range(ModelBlockGraphs.WAIT + 1):
        with graphs.training_forward():
            block(torch.randn(2, 16, 32))
        graphs.calls[0].fp8 = True  # recorded under FP8; the step now runs in BF16
        with caplog.at_level("INFO", logger="fp8_lightning.own_model_graphs"):
            graphs.before_step()
        if attempt < ModelBlockGraphs.WAIT:
            assert graphs.status == "recording" and graphs.calls == {}
            assert "FP8 off since the recording; recording their calls again" in caplog.text
    assert graphs.status == "off: no block ran in the FP8 state of the training step"
    assert not block._forward_pre_hooks


class Opaque(torch.nn.Linear):
    """Stands in for a TE layer: Dynamo must call it, not trace into it."""

    traced = 0

    def forward(self, x):
        Opaque.traced += torch.compiler.is_compiling()
        return super().forward(x)


class Block(torch.nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(d), Opaque(d, d)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.fc(self.norm(x).square()), approximate="tanh")


def test_compiled_block_forwards_leave_te_layers_to_eager_and_compile_every_block():
    """compile_blocks' Dynamo setting (own_model_graphs.te_layers_left_eager): each block's forward compiled
    around its TE layers (each called, not traced: here a stand-in), every block compiled,
    more blocks than Dynamo's default recompile limit, the same numbers as eager."""
    from fp8_lightning.own_model_graphs import te_layers_left_eager

    torch._dynamo.reset()
    blocks = [Block() for _ in range(12)]
    graphs_run = []

    def backend(gm, example_inputs):  # counts the compiled graphs' calls
        def run(*args):
            graphs_run.append(1)
            return gm(*args)
        return run

    x = torch.randn(2, 3, 8)
    Opaque.traced = 0
    with te_layers_left_eager(blocks, opaque=lambda m: isinstance(m, Opaque)):
        compiled = [torch.compile(type(b).forward.__get__(b), backend=backend) for b in blocks]
        outs = [f(x) for f in compiled]
    assert Opaque.traced == 0
    assert len(graphs_run) >= 2 * len(blocks)  # the norm's graph and the GELU's, every block
    for block, out in zip(blocks, outs):
        torch.testing.assert_close(out, block(x), rtol=0, atol=0)
    assert not any("forward" in vars(b.fc) for b in blocks)  # the layers' own forward again
    torch._dynamo.reset()


@pytest.mark.parametrize("primed", [True, False])
def test_compiled_blocks_are_primed_for_the_capture_after_te_s_warm_up(primed):
    """TE's warm-up calls each unit with a forward hook on every module, which Dynamo guards on;
    the capture calls it without. prime_compiled (TE's post_warmup_hook) compiles for the
    capture's calls, forward and backward, so the "capture" (here: the same calls, any compile
    an error) compiles nothing; unprimed, it would recompile mid-capture."""
    from fp8_lightning.graphs import prime_compiled
    from fp8_lightning.own_model_graphs import _BoundBlock, te_layers_left_eager

    torch._dynamo.reset()
    blocks = [Block() for _ in range(3)]
    units = [_BoundBlock(b, torch.compile(type(b).forward.__get__(b), backend="aot_eager"), {})
             for b in blocks]
    samples = [(torch.randn(2, 3, 8, requires_grad=True),) for _ in blocks]

    def forward_backward():
        outs = [unit(*args) for unit, args in zip(units, samples)]
        for out in reversed(outs):
            out.sum().backward()

    with te_layers_left_eager(blocks, opaque=lambda m: isinstance(m, Opaque)):
        for _ in range(2):  # TE's warm-up: a forward hook on every module of a unit
            hooks = [m.register_forward_hook(lambda *_: None) for u in units for m in u.modules()]
            forward_backward()
            for hook in hooks:
                hook.remove()
        try:
            if primed:
                prime_compiled(units, samples, None)
            else:
                torch.compiler.set_stance("fail_on_recompile")
            if primed:
                forward_backward()
            else:
                with pytest.raises(RuntimeError, match="recompile"):
                    forward_backward()
        finally:
            torch.compiler.set_stance("default")
    torch._dynamo.reset()
