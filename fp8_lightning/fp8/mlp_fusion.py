"""A user's ``LayerNorm -> Linear -> GELU(tanh) -> Linear`` as one TE ``LayerNormMLP`` (TE engine,
``Speedups(fuse_mlp=True)``): the norm writes fc1's FP8 input, and the GELU runs inside the
kernels that cast fc1's output for fc2 (forward) and fc2's input gradient (backward), instead of
an eager GELU, its backward and a cast of their own, as in this package's own GPT.

The GELU is a function call in the user's ``forward``, which no module swap can remove, so a
block whose chain fuses gets a ``forward`` of its own: the block's ``torch.fx`` graph (traced
into the submodules holding the chain only; every other submodule stays one call of its own
forward) with the four calls replaced by one call of the fused module (held where fc1 was). The
block's class becomes a subclass of the user's with that ``forward`` (``isinstance`` holds; a
CUDA graph captures it like any block's). Safe only where each call's output feeds the next call
alone and the trace holds for every call (no branch on ``train()``/``eval()``, no argument with
a default), which only the traced graph tells; any other block keeps its MLP, said in the log.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .norm_fusion import FusedNorm, fusable_norm


@dataclass(frozen=True)
class MLPChain:
    """One fusable chain, each name relative to its block (``<prefix>.<i>`` in the model)."""

    block: int
    norm: str
    fc1: str
    fc2: str


def _tanh_gelu(node: torch.fx.Node, block: nn.Module) -> bool:
    """``F.gelu(x, approximate="tanh")`` or an ``nn.GELU("tanh")`` module: TE's GELU. The exact
    (erf) GELU would change the model's numbers, so it does not fuse."""
    if node.op == "call_function" and node.target is F.gelu:
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return approximate == "tanh"
    if node.op == "call_module":
        module = block.get_submodule(node.target)
        return type(module) is nn.GELU and module.approximate == "tanh"
    return False


def _chain_at(norm: torch.fx.Node, block: nn.Module, calls: Counter) -> Optional[tuple]:
    """The ``(norm, fc1, act, fc2)`` nodes of a chain starting at ``norm``, or None."""

    def only_user(node: torch.fx.Node) -> Optional[torch.fx.Node]:
        users = list(node.users)
        if len(users) != 1 or users[0].args[:1] != (node,) or \
                (users[0].op == "call_module" and (len(users[0].args) != 1 or users[0].kwargs)):
            return None
        return users[0]

    def linear(node: Optional[torch.fx.Node]) -> Optional[nn.Linear]:
        if node is None or node.op != "call_module" or calls[node.target] != 1:
            return None
        module = block.get_submodule(node.target)
        return module if type(module) is nn.Linear else None

    if norm.op != "call_module" or calls[norm.target] != 1 or \
            not fusable_norm(block.get_submodule(norm.target)):
        return None
    fc1_node = only_user(norm)
    fc1 = linear(fc1_node)
    if fc1 is None:
        return None
    act = only_user(fc1_node)
    if act is None or not _tanh_gelu(act, block) or \
            (act.op == "call_module" and calls[act.target] != 1):
        return None
    fc2_node = only_user(act)
    fc2 = linear(fc2_node)
    norm_dims = block.get_submodule(norm.target).normalized_shape[0]
    if fc2 is None or fc1.in_features != norm_dims or fc2.in_features != fc1.out_features or \
            fc2.out_features != fc1.in_features or (fc1.bias is None) != (fc2.bias is None):
        return None  # LayerNormMLP: hidden -> ffn -> hidden, both biases or neither
    return norm, fc1_node, act, fc2_node


def mlp_chains(blocks: nn.ModuleList) -> tuple[list[MLPChain], str]:
    """The fusable chains of ``blocks`` and, where there is none, why."""
    chains = []
    for i, block in enumerate(blocks):
        try:
            graph = torch.fx.symbolic_trace(block).graph
        except Exception as err:  # data-dependent control flow, kwargs objects, ...: not traced
            return [], f"block {i} cannot be traced by torch.fx ({type(err).__name__})"
        calls = Counter(node.target for node in graph.nodes if node.op == "call_module")
        for node in graph.nodes:
            found = _chain_at(node, block, calls)
            if found:
                norm, fc1, _, fc2 = found
                chains.append(MLPChain(i, norm.target, fc1.target, fc2.target))
    return chains, "" if chains else "no LayerNorm -> Linear -> GELU(tanh) -> Linear in a block"


class FusedLinear(nn.Module):
    """A user's ``nn.Linear`` whose GEMM a fused module does (fc2 of a ``LayerNormMLP``): holds
    the layer's parameters under their own names (checkpoints, optimizer); never called, the
    block's fused ``forward`` calls the fused module instead."""

    def __init__(self, linear: nn.Linear, into: str) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features, self.into = \
            linear.in_features, linear.out_features, into

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"this layer's GEMM runs inside {self.into} (te.LayerNormMLP): the "
                           "block's fused forward calls that instead")

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, computed in {self.into}"


class _ChainTracer(torch.fx.Tracer):
    """Traces into the block and the submodules holding a chain's layers only: every other
    submodule stays one call, running its own forward (its train()/eval() behaviour, its
    hooks, its None checks) rather than a trace of it."""

    def __init__(self, into: set[str]) -> None:
        super().__init__()
        self.into = into

    def is_leaf_module(self, module: nn.Module, qualname: str) -> bool:
        return qualname not in self.into


def _trace(block: nn.Module, chains: list[MLPChain], training: bool
           ) -> tuple[torch.fx.GraphModule, torch.fx.Graph]:
    members = [name for c in chains for name in (c.norm, c.fc1, c.fc2)]
    into = {".".join(name.split(".")[:k]) for name in members
            for k in range(1, name.count(".") + 1)}
    tracer, was = _ChainTracer(into), block.training
    block.train(training)
    try:
        graph = tracer.trace(block)
    finally:
        block.train(was)
    return torch.fx.GraphModule(tracer.root, graph), graph


def fused_forward(block: nn.Module, chains: list[MLPChain]) -> tuple[Optional[Callable], str]:
    """The block's ``forward`` with each chain's four calls as one call of the module at its fc1
    name (traced now, before any module of the block is swapped), or None and why not: the
    trace must hold for every call, so the block's forward may not branch on ``train()`` /
    ``eval()`` or take arguments with defaults (a trace cannot tell ``None`` from a tensor)."""
    try:
        traced, graph = _trace(block, chains, True)
        evaluating, _ = _trace(block, chains, False)
    except Exception as err:  # noqa: BLE001 - the block keeps its MLP
        return None, f"cannot be traced by torch.fx ({type(err).__name__})"
    if traced.code != evaluating.code:
        return None, "its forward differs between train() and eval()"
    if any(node.op == "placeholder" and node.args for node in graph.nodes):
        return None, "its forward takes an argument with a default (a trace fixes its value)"
    members = {name for c in chains for name in (c.norm, c.fc1, c.fc2)}
    read = next((node.target for node in graph.nodes if node.op == "get_attr"
                 and node.target.rpartition(".")[0] in members), None)
    if read is not None:
        return None, f"its forward reads {read} itself"
    calls = Counter(node.target for node in graph.nodes if node.op == "call_module")
    nodes = {node.target: node for node in graph.nodes if node.op == "call_module"}
    for chain in chains:
        found = _chain_at(nodes[chain.norm], block, calls) if chain.norm in nodes else None
        if found is None or (found[1].target, found[3].target) != (chain.fc1, chain.fc2):
            return None, f"{chain.fc1}'s chain is not one in the block's own trace"
        norm, fc1, act, fc2 = found
        with graph.inserting_before(fc2):
            fused = graph.call_module(chain.fc1, (norm.args[0],))
        fc2.replace_all_uses_with(fused)
        for node in (fc2, act, fc1, norm):
            graph.erase_node(node)
    graph.lint()
    # GraphModule compiles the graph's code into a forward that reads submodules as attributes
    # of ``self``: bound to the user's block, it calls the block's own (swapped) modules
    return type(torch.fx.GraphModule(traced, graph)).forward, ""


def fuse_block(block: nn.Module, chains: list[MLPChain], prefix: str,
               make: Callable[[nn.LayerNorm, nn.Linear, nn.Linear], nn.Module]
               ) -> tuple[list[nn.Module], str]:
    """Swap each chain of ``block`` (named ``prefix`` in the model) for ``make(norm, fc1, fc2)``
    at fc1's name (holding their parameters), the norm and fc2 for holders of theirs, and give
    the block the fused ``forward``. Returns the fused modules, or none and why not."""
    forward, why = fused_forward(block, chains)
    if forward is None:
        return [], f"{prefix} {why}"
    fused = []
    for chain in chains:
        norm, fc1, fc2 = (block.get_submodule(n) for n in (chain.norm, chain.fc1, chain.fc2))
        module = make(norm, fc1, fc2)
        keep_mlp_keys(module)
        into = f"{prefix}.{chain.fc1}"
        for name, new in ((chain.fc1, module), (chain.norm, FusedNorm(norm, into)),
                          (chain.fc2, FusedLinear(fc2, into))):
            parent, _, attr = name.rpartition(".")
            setattr(block.get_submodule(parent), attr, new)
        fused.append(module)
    user_class = type(block)
    block.__class__ = type(user_class.__name__, (user_class,),
                           {"forward": forward, "__module__": user_class.__module__,
                            "__qualname__": user_class.__qualname__,
                            "_fp8_lightning_user_class": user_class})
    return fused, ""


# A fused module's own keys and the user's: fc1's parameters are the user's fc1 layer's
# ``weight``/``bias``; the norm's and fc2's are saved under their own layers' names.
_KEYS = {"fc1_weight": "weight", "fc1_bias": "bias"}
_ELSEWHERE = ("layer_norm_weight", "layer_norm_bias", "fc2_weight", "fc2_bias")


def keep_mlp_keys(fused: nn.Module) -> None:
    """A fused MLP module's state dict has the user's fc1 layer's keys (``weight``, ``bias``) and
    loads from them; the norm's and fc2's copies are left to their own layers' keys."""
    fused.register_state_dict_post_hook(_user_keys)
    fused.register_load_state_dict_pre_hook(_module_keys)


def _user_keys(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    for name in _ELSEWHERE:
        state_dict.pop(prefix + name, None)
    for own, user in _KEYS.items():
        if prefix + own in state_dict:
            state_dict[prefix + user] = state_dict.pop(prefix + own)


def _module_keys(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    for own, user in _KEYS.items():
        if prefix + user in state_dict:
            state_dict[prefix + own] = state_dict.pop(prefix + user)
    # The norm's and fc2's own keys load these parameters; the fused module copies them onto
    # themselves. fc1's stay the checkpoint's alone (a missing one is reported missing), and a
    # bias TE keeps as an empty tensor, not a parameter, has no key.
    for name in _ELSEWHERE:
        param = module._parameters.get(name)
        if param is not None:
            state_dict.setdefault(prefix + name, param.detach())
