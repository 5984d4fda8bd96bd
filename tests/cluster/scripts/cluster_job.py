"""The MPI job of tests/cluster/test_cluster.py: what every rank sees of the emulated cluster, and one allreduce.

Usage: python cluster_job.py ELEMENTS   (under benchmarks/cluster.py or EmulatedCluster.run)

Rank 0 prints one line ``CLUSTER_JOB <json>``: per rank its host name, the address it resolves that name to, the
world ranks of its ``Split_type(COMM_TYPE_SHARED)`` communicator, what ``mpistrategy.comm.topology.topology()``
reports, and whether an allreduce of ELEMENTS float32 values came out exactly right.
"""

from __future__ import annotations

import json
import socket
import sys

import numpy as np
from mpi4py import MPI

from mpistrategy.comm.topology import topology

world = MPI.COMM_WORLD
shared = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
nodes = topology()

# x_r = (i mod 1024) * (r + 1): every partial sum is an integer below 2^24, so the float32 sum is exact.
pattern = np.arange(int(sys.argv[1]), dtype=np.float32) % 1024
total = np.empty_like(pattern)
world.Allreduce(pattern * (world.rank + 1), total, op=MPI.SUM)
expected = pattern * (world.size * (world.size + 1) // 2)

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
}
records = world.gather(record, root=0)
if world.rank == 0:
    print("CLUSTER_JOB " + json.dumps(records), flush=True)
