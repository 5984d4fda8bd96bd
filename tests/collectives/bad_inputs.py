"""Bad input on one rank, case by case: the table that test_bad_input.py runs (the error caught on every rank) and
that this module runs as a script (the error not caught: the job must end)::

    mpiexec -n 3 python -m tests.collectives.bad_inputs allreduce-none

In each case every rank calls the same op and one rank, the culprit (the last rank), passes a bad argument.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from mpi4py import MPI

import mpistrategy as ms
from mpistrategy import CommunicationError

COMM = MPI.COMM_WORLD


def rank() -> int:
    return COMM.Get_rank()


def size() -> int:
    return COMM.Get_size()


def culprit() -> int:
    """The rank that passes the bad argument."""
    return size() - 1


def right(of: int) -> int:
    return (of + 1) % size()


def left(of: int) -> int:
    return (of - 1) % size()


@dataclass(frozen=True)
class Case:
    """One op called on every rank; ``call(True)`` on the culprit passes the bad argument."""

    op: str  # the op every rank's error names
    call: Callable[[bool], object]
    error: type[Exception]  # what the culprit raises; the other ranks raise a CommunicationError
    pairwise: bool = False  # point-to-point: only the culprit's peer (its right neighbour) learns of the error

    def raisers(self) -> set[int]:
        """The ranks that must raise."""
        return {culprit(), right(culprit())} if self.pairwise else set(range(size()))


def ones(bad: bool, bad_value: object = None) -> object:
    """A good tensor, or ``bad_value`` on the culprit."""
    return bad_value if bad else torch.ones(2 * size())


def meta(bad: bool) -> torch.Tensor:
    return torch.ones(2 * size(), device="meta" if bad else "cpu")


def typed(dtype: torch.dtype, good: torch.dtype = torch.float32) -> Callable[[bool], torch.Tensor]:
    return lambda bad: torch.ones(2 * size(), dtype=dtype if bad else good)


def ring(tensor: object) -> torch.Tensor:
    """Every rank sends to its right neighbour and receives from its left one."""
    return ms.sendrecv(tensor, right(rank()), left(rank()), tag=3)


def pair(bad: bool, send: Callable, receive: Callable, tensor: object) -> object:
    """The culprit sends ``tensor`` to its right neighbour, which is already waiting for it; others do nothing."""
    if bad:
        time.sleep(0.2)  # the receiver is waiting for the header by now
        return send(tensor, right(rank()))
    if rank() == right(culprit()):
        return receive(culprit())
    return None


CASES: dict[str, Case] = {
    "allreduce-none": Case("allreduce", lambda bad: ms.allreduce(ones(bad)), TypeError),
    "allreduce-bool-sum": Case("allreduce", lambda bad: ms.allreduce(typed(torch.bool)(bad)), TypeError),
    "allreduce-int-avg": Case("allreduce", lambda bad: ms.allreduce(typed(torch.int64)(bad), "avg"), TypeError),
    "allreduce-uint16": Case("allreduce", lambda bad: ms.allreduce(typed(torch.uint16)(bad)), TypeError),
    "allreduce-unknown-op": Case(
        "allreduce", lambda bad: ms.allreduce(ones(False), "mul" if bad else "sum"), ValueError
    ),
    "allreduce-bitwise-float": Case(
        "allreduce", lambda bad: ms.allreduce(typed(torch.float32, torch.int32)(bad), "bxor"), TypeError
    ),
    "allreduce-logical-float": Case(
        "allreduce", lambda bad: ms.allreduce(typed(torch.float64, torch.bool)(bad), "land"), TypeError
    ),
    "allreduce-prod-bool": Case("allreduce", lambda bad: ms.allreduce(typed(torch.bool)(bad), "prod"), TypeError),
    "allreduce-meta": Case("allreduce", lambda bad: ms.allreduce(meta(bad)), ValueError),
    "allreduce-out-shape": Case(
        "allreduce", lambda bad: ms.allreduce(ones(False), out=torch.empty(2 * size() + bad)), ValueError
    ),
    "iallreduce-none": Case("iallreduce", lambda bad: ms.iallreduce(ones(bad)).wait(), TypeError),
    "iallreduce-bool-sum": Case("iallreduce", lambda bad: ms.iallreduce(typed(torch.bool)(bad)).wait(), TypeError),
    "iallreduce-meta": Case("iallreduce", lambda bad: ms.iallreduce(meta(bad)).wait(), ValueError),
    "iallreduce-max": Case(
        "iallreduce", lambda bad: ms.iallreduce(ones(False), "max" if bad else "prod").wait(), ValueError
    ),
    "iallreduce-bitwise-float": Case(
        "iallreduce", lambda bad: ms.iallreduce(typed(torch.float16, torch.uint8)(bad), "bor").wait(), TypeError
    ),
    "reduce-none": Case("reduce", lambda bad: ms.reduce(ones(bad), root=0), TypeError),
    "reduce-logical-complex": Case(
        "reduce", lambda bad: ms.reduce(typed(torch.complex64, torch.int64)(bad), op="lor"), TypeError
    ),
    "reduce-prod-bool": Case("reduce", lambda bad: ms.reduce(typed(torch.bool)(bad), op="prod"), TypeError),
    "reduce-root-out-of-range": Case(
        "reduce", lambda bad: ms.reduce(ones(False), root=size() if bad else 0), ValueError
    ),
    "reduce_scatter-none": Case("reduce_scatter", lambda bad: ms.reduce_scatter(ones(bad)), TypeError),
    "reduce_scatter-bitwise-float": Case(
        "reduce_scatter", lambda bad: ms.reduce_scatter(typed(torch.float32, torch.int8)(bad), op="band"), TypeError
    ),
    "reduce_scatter-indivisible": Case(
        "reduce_scatter", lambda bad: ms.reduce_scatter(torch.ones(2 * size() + bad)), ValueError
    ),
    "reduce_scatter_v-0-dimensional": Case(
        "reduce_scatter_v", lambda bad: ms.reduce_scatter_v(torch.tensor(1.0) if bad else ones(False)), ValueError
    ),
    "reduce_scatter_v-bad-sizes": Case(
        "reduce_scatter_v",
        lambda bad: ms.reduce_scatter_v(ones(False), [2] * (size() - 1) + [2 + bad]),
        ValueError,
    ),
    "broadcast-root-out-of-range": Case(
        "broadcast", lambda bad: ms.broadcast(ones(False), root=size() if bad else 0), ValueError
    ),
    "broadcast-different-roots": Case(
        "broadcast", lambda bad: ms.broadcast(ones(False), root=culprit() if bad else 0), CommunicationError
    ),
    "broadcast-root-passes-none": Case("broadcast", lambda bad: ms.broadcast(ones(bad), root=culprit()), ValueError),
    "broadcast-meta-on-root": Case("broadcast", lambda bad: ms.broadcast(meta(bad), root=culprit()), ValueError),
    "broadcast-meta-on-receiver": Case("broadcast", lambda bad: ms.broadcast(meta(bad), root=0), ValueError),
    "broadcast-receiver-passes-a-list": Case(
        "broadcast",
        lambda bad: ms.broadcast([1.0] if bad else torch.ones(2, requires_grad=True) if rank() == 0 else None, root=0),
        TypeError,
    ),
    "broadcast-out-with-autograd": Case(
        "broadcast",
        lambda bad: ms.broadcast(
            torch.ones(2, requires_grad=True) if rank() == 0 else None, root=0, out=torch.empty(2) if bad else None
        ),
        ValueError,
    ),
    "gather-none": Case("gather", lambda bad: ms.gather(ones(bad), root=0), TypeError),
    "gather-root-out-of-range": Case("gather", lambda bad: ms.gather(ones(False), root=-1 if bad else 0), ValueError),
    "gather_v-bad-sizes": Case(
        "gather_v", lambda bad: ms.gather_v(ones(False), root=0, sizes=[2 * size()] * (size() - bad)), ValueError
    ),
    "scatter-root-passes-none": Case("scatter", lambda bad: ms.scatter(ones(bad), root=culprit()), ValueError),
    "scatter-indivisible-on-root": Case(
        "scatter", lambda bad: ms.scatter(torch.ones(2 * size() + bad), root=culprit()), ValueError
    ),
    "scatter-meta-device-on-receiver": Case(
        "scatter", lambda bad: ms.scatter(ones(False), root=0, device="meta" if bad else None), ValueError
    ),
    "scatter_v-bad-sizes-on-root": Case(
        "scatter_v",
        lambda bad: ms.scatter_v(ones(False), root=culprit(), sizes=[1] * size() if bad else None),
        ValueError,
    ),
    "allgather-meta": Case("allgather", lambda bad: ms.allgather(meta(bad)), ValueError),
    "allgather-uint16": Case("allgather", lambda bad: ms.allgather(typed(torch.uint16)(bad)), TypeError),
    "allgather-dim-not-int": Case("allgather", lambda bad: ms.allgather(ones(False), dim=0.5 if bad else 0), TypeError),
    "allgather_v-none": Case("allgather_v", lambda bad: ms.allgather_v(ones(bad)), TypeError),
    "alltoall-none": Case("alltoall", lambda bad: ms.alltoall(ones(bad)), TypeError),
    "alltoall-indivisible": Case("alltoall", lambda bad: ms.alltoall(torch.ones(2 * size() + bad)), ValueError),
    "alltoall_v-bad-sizes": Case(
        "alltoall_v", lambda bad: ms.alltoall_v(ones(False), [2] * (size() - 1) + [2 + bad]), ValueError
    ),
    "reduce_from_parallel-none": Case(
        "reduce_from_parallel", lambda bad: ms.reduce_from_parallel(ones(bad)), TypeError
    ),
    "sendrecv-none": Case("sendrecv", lambda bad: ring(ones(bad)), TypeError, pairwise=True),
    "sendrecv-meta": Case("sendrecv", lambda bad: ring(meta(bad)), ValueError, pairwise=True),
    "send-none": Case("send", lambda bad: pair(bad, ms.send, ms.recv, ones(bad)), TypeError, pairwise=True),
    "isend-meta": Case(
        "isend",
        lambda bad: pair(bad, lambda t, dst: ms.isend(t, dst).wait(), lambda src: ms.irecv(src).wait(), meta(bad)),
        ValueError,
        pairwise=True,
    ),
}

# The cases whose job is also run with nothing caught, one per path through the code (the agreement message of
# the blocking and the non-blocking ops and of the gathers, broadcast's header exchange, the point-to-point failure
# notice): whether the job ends depends only on every rank raising, which the caught runs show for every case.
UNCAUGHT = ["allreduce-none", "iallreduce-bool-sum", "allgather-meta", "broadcast-different-roots", "sendrecv-none"]
STARTED = "calling the op at"


def main(name: str) -> None:
    """Run one case with nothing caught: every rank that raises ends with its traceback."""
    case = CASES[name]
    COMM.Barrier()
    if rank() == 0:
        print(f"{STARTED} {time.time():.3f}", flush=True)
    case.call(rank() == culprit())


if __name__ == "__main__":
    main(sys.argv[1])
