"""The ranks that split one copy of the sharded state, and the ranks that hold the same shard elsewhere.

Under ``flat`` sync every rank holds one shard of a single copy (``N`` = the world size). Under ``hierarchical``
sync each node holds a copy split among its ``L`` ranks, so that the parameter allgather never leaves the node
(ZeRO++'s hierarchical partitioning); the ranks with the same local rank on the other nodes (the topology's cross
communicator) hold the same shard, and under ``shard="gradients"`` they average its gradients across nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpi4py import MPI

from mpistrategy.comm.topology import Topology, ready_for_objects


@dataclass
class ShardGroup:
    """Private communicators of the sharded state.

    Attributes:
        comm: the ranks that split one copy (their shard ``r`` is their rank in it).
        cross: the ranks holding this rank's shard on every node (``None`` with one copy of the state).
        span: every rank (whose gradients are averaged).
        world_size: every rank's count, ``P``: gradients are averaged over all of them.
        writes_checkpoint: whether this rank saves its shard in checkpoints (the copy that rank 0 belongs to).
    """

    comm: MPI.Intracomm
    cross: MPI.Intracomm | None
    span: MPI.Intracomm
    world_size: int
    writes_checkpoint: bool

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        return self.comm.Get_size()


_groups: dict[tuple[int, bool], ShardGroup] = {}


def shard_group(topology: Topology, per_node: bool) -> ShardGroup:
    """The group of ``topology``: one copy over all ranks, or (``per_node``) one copy per node. Built on first use
    (collective: it duplicates communicators), then kept for the process's lifetime, as the topology's own
    communicators are, so that a sharded optimizer can still be saved after training ended."""
    key = (topology.control.py2f(), per_node)
    if key not in _groups:
        _groups[key] = _build(topology, per_node)
    return _groups[key]


def _build(topology: Topology, per_node: bool) -> ShardGroup:
    if not per_node:
        comm = ready_for_objects(topology.control.Dup())
        return ShardGroup(comm, None, comm, topology.size, True)
    cross = ready_for_objects(topology.cross_comm.Dup()) if topology.num_nodes > 1 else None
    shard = ready_for_objects(topology.node_comm.Dup())
    return ShardGroup(shard, cross, ready_for_objects(topology.control.Dup()), topology.size, topology.node_rank == 0)
