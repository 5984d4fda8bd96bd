"""A rank that ends its script with communication no peer will complete (see tests/comm/test_diagnosis.py).

argv[1]: "gradient": rank 0 sends a tensor that requires grad and never runs backward through the send, so the
gradient rank 1 sends back in its backward is never received; "dropped": rank 0 drops a non-blocking allreduce
that rank 1 never joins. Messages of 4 MB go by rendezvous: the sends cannot complete without their receives.
Both ranks print ``END <rank>`` when their script ends.
"""

import sys

import torch
from mpi4py import MPI

import mpistrategy as ms

rank = MPI.COMM_WORLD.Get_rank()
case = sys.argv[1]
x = torch.randn(1 << 20, requires_grad=case == "gradient")
if case == "gradient":
    if rank == 0:
        ms.isend(x, 1).wait()  # its placeholder never joins backward
    else:
        (ms.irecv(0).wait() * 2).sum().backward()  # sends the gradient back to rank 0
elif rank == 0:
    with ms.validation(False):
        ms.iallreduce(x)  # dropped at once: parked until it completes
sys.stdout.write(f"END {rank}\n")
sys.stdout.flush()
