"""Communicators with private channels for forward and backward traffic.

Each MPI communicator a user hands to mpistrategy is wrapped once in a :class:`Communicator`, which duplicates it
three times: one copy carries the forward messages of every op, one the backward messages, and one the cross-rank
checks of the ops' arguments (:mod:`mpistrategy.comm.checks`). Because the copies are distinct MPI communicators,
a backward message can never be matched by a forward one, nor a check by a payload (nor any of them by the user's
own traffic on the original communicator), whatever the tags and sizes.

The wrapper is cached on the MPI communicator itself, as an MPI attribute (``MPI_Comm_set_attr``): MPI deletes it
when the communicator is freed, so a communicator created later, which MPI may give the freed one's handle, is
wrapped anew instead of running on the freed one's members. The duplicates of a user's communicator stay allocated
until the process ends (an op's backward pass, or a non-blocking op's ``wait()``, may still use them after the
user freed it). The communicators mpistrategy duplicates for itself are freed, channels included, by
:meth:`Communicator.free` when their owner is done with them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import numpy as np
from mpi4py import MPI

from mpistrategy.comm import calls

#: int64 values of the fingerprint every op's argument check exchanges: digest, -digest, call count, -count, and a
#: payload some ops send with it (see :mod:`mpistrategy.comm.checks` and :mod:`mpistrategy.comm.metadata`)
FINGERPRINT_LENGTH = 20


class Communicator:
    """An MPI communicator plus its private forward and backward channels.

    Creating one is collective over ``comm`` (it calls ``MPI_Comm_dup`` three times); afterwards it is cached, so
    :func:`resolve` returns the same object for the same MPI communicator.
    """

    def __init__(self, comm: MPI.Comm | Communicator) -> None:
        if isinstance(comm, Communicator):
            comm = comm.comm
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise TypeError(f"expected an mpi4py intracommunicator (such as MPI.COMM_WORLD), got {comm!r}.")
        self.comm: MPI.Intracomm = comm
        self.forward = comm.Dup()
        self.backward = comm.Dup()
        self.checks = comm.Dup()
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        # The fixed-size fingerprint that the cross-rank argument check (checks.agree) reduces on the checks channel,
        # and the two int64 it offers to a shared-memory group instead; reused by every call, which is safe because
        # MPI forbids concurrent collectives on one communicator anyway.
        self.fingerprint = np.zeros(FINGERPRINT_LENGTH, dtype=np.int64)
        self.agreement = np.zeros(2, dtype=np.int64)
        self.calls = 0  # collectives this process called on it (see calls.enter)
        self.channel = calls.register(world_ranks(comm))
        comm.Set_attr(_WRAPPER, self)

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size})"

    def free(self) -> None:
        """Free what mpistrategy made on this communicator (shared-memory groups, the channels), then the
        communicator itself (collective): for one made for this wrapper (a duplicate), once its owner is done with
        it and nothing on it is in flight. A user's communicator is never freed by mpistrategy. Idempotent."""
        if self.comm == MPI.COMM_NULL:
            return
        for release in _releases:
            release(self)
        for channel in (self.forward, self.backward, self.checks):
            channel.Free()
        self.comm.Free()


#: what holds resources on a communicator's channels: each is called with the wrapper before its channels are freed
_releases: list[Callable[[Communicator], None]] = []


def on_release(release: Callable[[Communicator], None]) -> None:
    """Call ``release(wrapper)`` (collective over its ranks) when :meth:`Communicator.free` frees a communicator."""
    _releases.append(release)


#: the attribute under which an MPI communicator holds its :class:`Communicator` (deleted with the communicator)
_WRAPPER = MPI.Comm.Create_keyval()


def _wrapper_of(comm: MPI.Comm) -> Communicator | None:
    """The :class:`Communicator` cached on ``comm``, if any."""
    if comm == MPI.COMM_NULL:
        return None
    return cast("Communicator | None", comm.Get_attr(_WRAPPER))


def world_ranks(comm: MPI.Intracomm) -> tuple[int, ...]:
    """The world rank of every rank of ``comm``, in ``comm``'s order."""
    world_group, group = MPI.COMM_WORLD.Get_group(), comm.Get_group()
    try:
        return tuple(MPI.Group.Translate_ranks(group, list(range(comm.Get_size())), world_group))
    finally:
        group.Free()
        world_group.Free()


_world: Communicator | None = None  # COMM_WORLD is never freed: its wrapper is kept here, no attribute lookup per op


def world() -> Communicator:
    """The wrapped ``MPI.COMM_WORLD`` (created when mpistrategy is imported, on every rank)."""
    global _world
    if _world is None:
        _world = _wrapper_of(MPI.COMM_WORLD) or Communicator(MPI.COMM_WORLD)
    return _world


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
    found = _wrapper_of(comm) if isinstance(comm, MPI.Comm) else None
    if found is not None:
        return found
    if not collective:
        raise ValueError(
            "point-to-point ops on a new communicator need its backward channel first: call "
            "mpistrategy.Communicator(comm) on every rank of comm (it is collective), then pass it or comm."
        )
    return Communicator(comm)
