"""Where a training step may replay CUDA graphs (the replays themselves need a GPU:
tests/test_gpu_fast_path.py and tests/test_gpu_engines.py run them)."""

import pytest

from fp8_lightning.graphs import graphs_status


class FP8Stats:  # graphs_status knows the callback by its class name (no TE import needed)
    pass


@pytest.mark.parametrize("where, reason", [
    (dict(device_type="cpu", world_size=1), "CUDA graphs need a GPU"),
    (dict(device_type="cuda", world_size=2, sharded=True), "FSDP2's hooks run in Python"),
    # FSDP2 over one GPU: a captured block would run its forward before FSDP2's root
    (dict(device_type="cuda", world_size=1, sharded=True), "FSDP2's hooks run in Python"),
    (dict(device_type="cuda", world_size=1, callbacks=[FP8Stats()]), "FP8Stats"),
])
def test_graphs_stay_off_where_a_replay_would_skip_python_and_say_why(where, reason):
    ok, why = graphs_status(**where)
    assert not ok and reason in why


def test_one_unsharded_gpu_replays_the_stack_and_ddp_a_graph_per_block():
    assert graphs_status("cuda", 1, [], sharded=False) == (True, "one GPU")
    # DDP's all-reduce runs in autograd hooks between the blocks' backward replays
    assert graphs_status("cuda", 2, [], sharded=False) == (True, "DDP, a graph per block")
