"""The device mesh FSDP2 shards on: Lightning's data-parallel mesh (FSDP2), or a 2-D
(replicate, shard) mesh of the same ranks (HSDP: ``FSDP2Strategy(replicate=N)``), and the checks
of ``replicate``. One module for the Trainer's strategy and a Fabric ``parallelize_fn``."""

from __future__ import annotations

from typing import Any, Optional


def replica_problems(replicate: Any, world_size: Optional[int] = None) -> list[str]:
    """What is wrong with FSDP2Strategy's ``replicate`` (for a world of ``world_size`` ranks,
    where known): one line each, with what is valid."""
    if replicate is None:
        return []
    if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 1:
        return [f"replicate={replicate!r}; valid: null (one replica per node), 1 (plain FSDP2) "
                "or an integer >= 1 that divides the world size"]
    if world_size is not None and world_size % replicate:
        valid = ", ".join(str(n) for n in range(1, world_size + 1) if world_size % n == 0)
        return [f"replicate={replicate} does not divide the world size {world_size} (devices x "
                f"num_nodes); valid: {valid}"]
    return []


def replicas(replicate: Optional[int], num_nodes: int) -> int:
    """HSDP's replica count: ``replicate`` as given, or (None) one per node, so that the
    all-gathers stay within a node (1 on one node: plain FSDP2)."""
    return max(1, num_nodes) if replicate is None else replicate


def fsdp2_mesh(mesh: Any, replicate: int = 1) -> Any:
    """The mesh ``fully_shard`` takes, from Lightning's (data_parallel, tensor_parallel) mesh
    (``ModelParallelStrategy``'s, the Trainer's or Fabric's, tensor-parallel size 1): with one
    replica its 1-D data-parallel mesh (FSDP2); with ``replicate`` > 1 a 2-D (replicate, shard)
    mesh of the same ranks (HSDP), consecutive ranks (a node's, as launchers number them) in one
    shard group. Lightning's mesh stays the data-parallel one: samplers split data over every
    rank either way."""
    from torch.distributed.device_mesh import init_device_mesh

    from .config import ConfigError

    data_parallel = mesh["data_parallel"]
    world = data_parallel.size()
    problems = replica_problems(replicate, world)
    if mesh.size() != world:
        problems.append(f"a tensor-parallel size of {mesh.size() // world}; valid: 1 "
                        "(data_parallel_size = world size)")
    if problems:
        raise ConfigError(problems, "FSDP2 mesh")
    if replicate == 1:
        return data_parallel
    return init_device_mesh(mesh.device_type, (replicate, world // replicate),
                            mesh_dim_names=("replicate", "shard"))


def describe_mesh(mesh: Any) -> str:
    """The layout of a :func:`fsdp2_mesh`, for the log."""
    if mesh.ndim == 1:
        return f"one replica sharded over {mesh.size()} rank(s)"
    replicate, shard = mesh.shape
    return (f"HSDP, {replicate} replicas x {shard} shard{'s' if shard > 1 else ''} "
            "(all-gathers within a replica group)")
