"""Ranks that call different collectives, then a rank that never arrives (see tests/comm/test_diagnosis.py).

argv[1]: how the late rank (the last one) fails to arrive: "sleep" (a C call) or "spin" (a Python loop); "late"
sleeps 8 s and then arrives (for the watchdog's warn mode); "gil" holds the GIL in a C call (a regular expression
that backtracks for minutes), so that its watchdog cannot answer; "objects" waits in mpi4py's object allreduce on
the strategy's control communicator, which the others never join. None of the last three runs the desync cases.
Each caught error is printed as ``CAUGHT <rank> <message>``; ``HANG <time>`` marks when the stall begins.
"""

import re
import sys
import time

import torch
from mpi4py import MPI

import mpistrategy as ms
from mpistrategy.comm.topology import topology

rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
late = size - 1
x = torch.ones(4)


def say(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write: the launcher does not interleave it with other ranks' lines
    sys.stdout.flush()


def attempt(case: str, call) -> None:
    try:
        call()
    except ms.CommunicationError as error:
        say(f"CAUGHT {case} {rank} {error}")
    else:
        say(f"PASSED {case} {rank}")


def different_ops() -> None:
    if rank == late:
        ms.broadcast(x, root=0)  # marker: broadcast
    else:
        ms.allreduce(x)  # marker: allreduce


def other_arguments() -> None:
    ms.allreduce(torch.ones(4 + (rank == late)), op="max" if rank == late else "sum")  # marker: other arguments


def skipped_call() -> None:
    if rank != late:
        ms.allgather(x)  # marker: skipped
    ms.allreduce(x)  # marker: after skipped


def behind() -> None:
    with ms.validation(False):
        if rank != late:
            pending.append(ms.iallreduce(x))  # marker: unchecked
    ms.allreduce(x)  # marker: after unchecked


pending: list[ms.Handle] = []
control = topology().control  # built by every rank (collective)
if sys.argv[1] not in ("late", "gil", "objects"):
    attempt("different_ops", different_ops)
    attempt("other_arguments", other_arguments)
    attempt("skipped_call", skipped_call)
    attempt("behind", behind)
    with ms.validation(False):
        if rank == late:
            pending.append(ms.iallreduce(x))
    for handle in pending:
        assert torch.equal(handle.wait(), torch.full((4,), float(size)))
assert torch.equal(ms.allreduce(x), torch.full((4,), float(size)))  # every rank still in step
MPI.COMM_WORLD.Barrier()
say(f"HANG {time.time()}")
if rank == late:
    if sys.argv[1] == "late":
        time.sleep(8)
    elif sys.argv[1] == "gil":
        re.match(r"(a+)+$", "a" * 40 + "b")  # marker: gil
    elif sys.argv[1] == "objects":
        control.allreduce(1)  # marker: objects
    elif sys.argv[1] == "sleep":
        time.sleep(120)  # marker: sleep
    else:
        deadline = time.time() + 120
        while time.time() < deadline:  # marker: spin
            pass
ms.allreduce(x)  # marker: waits
say("UNREACHED" if sys.argv[1] != "late" else f"ARRIVED {rank}")
