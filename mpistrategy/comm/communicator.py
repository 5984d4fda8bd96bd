"""Communicators with private channels for forward and backward traffic.

Each MPI communicator a user hands to mpistrategy is wrapped once in a :class:`Communicator`, which duplicates it
twice: one copy carries the forward messages of every op, the other the backward messages. Because the copies
are distinct MPI communicators, a backward message can never be matched by a forward one (nor by the user's own
traffic on the original communicator), whatever the tags.
"""

from __future__ import annotations

import threading

import numpy as np
from mpi4py import MPI


class Communicator:
    """An MPI communicator plus its private forward and backward channels.

    Creating one is collective over ``comm`` (it calls ``MPI_Comm_dup`` twice); afterwards it is cached, so
    :func:`resolve` returns the same object for the same MPI communicator.
    """

    def __init__(self, comm: MPI.Comm) -> None:
        if isinstance(comm, Communicator):
            comm = comm.comm
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise TypeError(f"expected an mpi4py intracommunicator (such as MPI.COMM_WORLD), got {comm!r}.")
        self.comm = comm
        self.forward = comm.Dup()
        self.backward = comm.Dup()
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        # Two int64 that the cross-rank argument check (checks.agree) reduces on the forward channel; reused by
        # every call, which is safe because MPI forbids concurrent collectives on one communicator anyway.
        self.agreement = np.zeros(2, dtype=np.int64)
        with _lock:
            _registry[_key(comm)] = self

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size})"


_registry: dict[int, Communicator] = {}
_lock = threading.Lock()


def _key(comm: MPI.Comm) -> int:
    return comm.py2f()


def world() -> Communicator:
    """The wrapped ``MPI.COMM_WORLD`` (created when mpistrategy is imported, on every rank)."""
    found = _registry.get(_key(MPI.COMM_WORLD))
    return found if found is not None else Communicator(MPI.COMM_WORLD)


def resolve(comm: MPI.Comm | Communicator | None, *, collective: bool = True) -> Communicator:
    """The :class:`Communicator` for ``comm`` (default: the world).

    Collective ops may wrap a new communicator on first use, since every rank of it is taking part.
    Point-to-point ops (``collective=False``) cannot: wrapping is collective, so they require
    ``mpistrategy.Communicator(comm)`` to have been created on all ranks of ``comm`` first.
    """
    if comm is None:
        return world()
    if isinstance(comm, Communicator):
        return comm
    found = _registry.get(_key(comm)) if isinstance(comm, MPI.Comm) else None
    if found is not None:
        return found
    if not collective:
        raise ValueError(
            "point-to-point ops on a new communicator need its backward channel first: call "
            "mpistrategy.Communicator(comm) on every rank of comm (it is collective), then pass it or comm."
        )
    return Communicator(comm)
