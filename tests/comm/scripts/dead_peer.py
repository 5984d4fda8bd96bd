"""Rank 1's process ends abruptly (no MPI_Finalize, no cleanup) while rank 0 waits for it in a shared-memory
allreduce. Rank 0 must raise, not wait forever.

Run by tests/comm/test_shm_failures.py under ``mpiexec -disable-auto-cleanup`` (the launcher leaves rank 0 alone
when rank 1 ends, so only the library's own check can end it). Rank 1 ends by ``os._exit``, not by a signal: Hydra's
proxy kills every rank of a job in which one died of a signal, ``-disable-auto-cleanup`` or not. Writes ``RAISED
after <s> s: <error>`` (or ``NOT RAISED``) to the file ``$DEAD_PEER_REPORT`` and exits 3.
"""

from __future__ import annotations

import os
import time

import torch
from mpi4py import MPI

import mpistrategy as ms

ms.set_shared_memory("on")
rank = MPI.COMM_WORLD.Get_rank()
tensor = torch.ones(100_000)
assert torch.equal(ms.allreduce(tensor), tensor * 2)  # both ranks have built the group
if rank == 1:
    os._exit(9)
started = time.monotonic()
try:
    ms.allreduce(tensor)
except ms.CommunicationError as error:
    with open(os.environ["DEAD_PEER_REPORT"], "w") as report:
        report.write(f"RAISED after {time.monotonic() - started:.1f} s: {error}")
    os._exit(3)
with open(os.environ["DEAD_PEER_REPORT"], "w") as report:
    report.write("NOT RAISED")
