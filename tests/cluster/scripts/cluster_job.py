"""The MPI job of tests/cluster/test_cluster.py: what every rank sees of the emulated cluster, and one allreduce.

Usage: python cluster_job.py ELEMENTS   (under benchmarks/cluster.py or EmulatedCluster.run)

Rank 0 prints one line ``CLUSTER_JOB <json>``: per rank its host name, the address it resolves that name to, the
world ranks of its ``Split_type(COMM_TYPE_SHARED)`` communicator, what ``mpistrategy.comm.topology.topology()``
reports, whether an allreduce of ELEMENTS float32 values came out exactly right, and, for mpi_ad's gradient
reducer with hierarchical sync (the node sums through shared memory, across nodes through MPI), whether every
bucket lives in the node's shared window, whether the node step went through shared memory, and whether the
averaged gradient equals the flat average computed with MPI.
"""

from __future__ import annotations

import json
import socket
import sys

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from mpistrategy.aggregation import MeanAggregator
from mpistrategy.comm.shm import built_group
from mpistrategy.comm.shm_window import locate
from mpistrategy.comm.topology import topology
from mpistrategy.strategy.reducer import GradientReducer
from mpistrategy.sync import HierarchicalSync, SyncContext

world = MPI.COMM_WORLD
shared = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
nodes = topology()

# x_r = (i mod 1024) * (r + 1): every partial sum is an integer below 2^24, so the float32 sum is exact.
pattern = np.arange(int(sys.argv[1]), dtype=np.float32) % 1024
total = np.empty_like(pattern)
world.Allreduce(pattern * (world.rank + 1), total, op=MPI.SUM)
expected = pattern * (world.size * (world.size + 1) // 2)


def hierarchical_gradients() -> dict[str, bool]:
    """One backward pass of a model with a 2 MB weight (its own bucket without shared memory) through the reducer
    with hierarchical sync, in float64 against the flat mean over MPI."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 4)).double()
    sync = HierarchicalSync()
    sync.setup(SyncContext(model, nodes, MeanAggregator()))
    reducer = GradientReducer(model, sync, nodes)
    generator = torch.Generator().manual_seed(world.rank)
    x = torch.randn(16, 512, generator=generator, dtype=torch.float64)
    local = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    flat = [np.empty_like(g.numpy()) for g in local]
    for grad, out in zip(local, flat, strict=True):
        world.Allreduce(grad.numpy(), out, op=MPI.SUM)
    reducer.prepare(sync=True)
    model(x).square().sum().backward()
    reducer.wait()
    node_group = built_group(nodes.node_gradients.forward)
    result = {
        "buckets_in_window": all(locate(b.buffer) is not None for b in reducer.buckets),
        "node_step_in_shared_memory": node_group is not None and node_group.seq > 0,
        "equals_flat": all(
            np.allclose(p.grad.numpy(), out / world.size, rtol=1e-12, atol=1e-14)
            for p, out in zip(model.parameters(), flat, strict=True)
        ),
    }
    reducer.remove()
    return result


hostname = socket.gethostname()
record = {
    "rank": world.rank,
    "hostname": hostname,
    "address": socket.gethostbyname(hostname),
    "shared_ranks": shared.allgather(world.rank),
    "num_nodes": nodes.num_nodes,
    "node_rank": nodes.node_rank,
    "local_rank": nodes.local_rank,
    "node_sizes": list(nodes.node_sizes),
    "virtual": nodes.virtual,
    "main_address": nodes.main_address,
    "allreduce_exact": bool(np.array_equal(total, expected)),
    **hierarchical_gradients(),
}
records = world.gather(record, root=0)
if world.rank == 0:
    print("CLUSTER_JOB " + json.dumps(records), flush=True)
