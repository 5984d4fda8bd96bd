"""A non-blocking bitwise-or allreduce of a small byte vector, through shared memory where the ranks share it.

For the strategy's exchange of which parameters got a gradient (one byte per parameter, once per step). MPI's
non-blocking allreduce of it completes only while the ranks call into MPI, which they hardly do during a step once
the gradients go through shared memory: its wait then becomes a meeting point with a busy-polling peer. Through
shared memory, every rank writes its vector into one of two slots (used in turn) of a small segment and publishes
the round (:mod:`mpistrategy.comm.shm_flags`); a rank that has seen every rank reach the round ORs the slots. A
rank posts round k + 2 into the slot of round k only after completing round k + 1, which every rank posted after
completing (reading) round k.

:func:`or_exchange` picks the shared-memory exchange when the ranks share memory and shared memory is not off
(:func:`~mpistrategy.comm.shm.settings.shared_memory_mode`), else MPI's ``Iallreduce``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from mpi4py import MPI

from mpistrategy.comm.shm.settings import shared_memory_mode
from mpistrategy.comm.shm_flags import ARRIVED, Flags
from mpistrategy.comm.shm_window import allocate

_LINE = 64


class OrExchange(Protocol):
    """``post`` a vector; ``wait`` until ``out`` holds the bitwise or of every rank's; ``close`` (collective)."""

    def post(self, values: np.ndarray, out: np.ndarray) -> None: ...

    def wait(self) -> None: ...

    def close(self) -> None: ...


class SharedOr:
    """The exchange through shared memory (collective over ``comm``, whose ranks share memory, to build).

    Args:
        comm: the ranks (the exchange frees it when closed).
        nbytes: the length of the vectors (uint8).
    """

    def __init__(self, comm: MPI.Intracomm, nbytes: int) -> None:
        self._comm = comm
        self.flags = Flags(comm)
        stride = -(-max(nbytes, 1) // _LINE) * _LINE
        self._segment = allocate(2 * stride, comm)
        self._slots = [
            [self._segment.part(r)[k * stride : k * stride + nbytes].numpy() for k in (0, 1)]
            for r in range(comm.Get_size())
        ]
        self._mine = self._slots[self.flags.rank]
        self._round = 0
        self._out: np.ndarray | None = None

    def post(self, values: np.ndarray, out: np.ndarray) -> None:
        """Offer ``values``; :meth:`wait` writes the or of every rank's into ``out``."""
        self.wait()
        self._round += 1
        np.copyto(self._mine[self._round & 1], values)
        self.flags.publish(ARRIVED, self._round)
        self._out = out

    def wait(self) -> None:
        if self._out is None:
            return
        round_ = self._round
        self.flags.wait_until(lambda: self.flags.all_reached(ARRIVED, round_))
        self.flags.acquire()
        np.bitwise_or.reduce([slots[round_ & 1] for slots in self._slots], out=self._out)
        self._out = None

    def close(self) -> None:
        self.wait()
        self._slots, self._mine = [], []
        self._segment.free()
        self.flags.close()
        self._comm.Free()


class MPIOr:
    """The exchange through MPI's non-blocking allreduce, on a private duplicate of ``comm``."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self._comm = comm.Dup()
        self._request: MPI.Request | None = None

    def post(self, values: np.ndarray, out: np.ndarray) -> None:
        self.wait()
        self._request = self._comm.Iallreduce(values, out, op=MPI.BOR)

    def wait(self) -> None:
        if self._request is not None:
            self._request.Wait()
            self._request = None

    def close(self) -> None:
        self.wait()
        self._comm.Free()


def or_exchange(comm: MPI.Intracomm, nbytes: int) -> OrExchange:
    """The exchange of ``nbytes``-long vectors over ``comm`` (collective): through shared memory when every rank
    of ``comm`` shares this machine's memory and shared memory is not off, else through MPI."""
    if shared_memory_mode() != "off":
        shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        if shared.Get_size() == comm.Get_size():
            return SharedOr(shared, nbytes)  # type: ignore[arg-type]  # mpi4py types Split_type's result as Comm
        shared.Free()
    return MPIOr(comm)
