"""The groups of this process, one per communicator channel, built on first use; the ranks that share buffers."""

from __future__ import annotations

import threading

import torch
from mpi4py import MPI

from mpistrategy.comm.checks import Exchange, check_on_node
from mpistrategy.comm.communicator import Communicator, on_release
from mpistrategy.comm.shm.group import SharedMemoryGroup
from mpistrategy.comm.shm.settings import require_alike, shared_memory_mode, uses_shared_memory
from mpistrategy.comm.shm_window import machine_comm

_groups: dict[int, SharedMemoryGroup | None] = {}  # by the channel's Fortran handle; None: no shared memory
_lock = threading.Lock()


def group_for(channel: MPI.Intracomm, tensor: torch.Tensor, op: str) -> SharedMemoryGroup | None:
    """The shared-memory group that reduces ``tensor`` with ``op`` on ``channel``, or ``None`` for MPI.

    Collective over ``channel`` the first time a message qualifies on it (it finds out whether the ranks share
    memory, and builds the group).
    """
    if not uses_shared_memory(tensor, op, channel.Get_size()):
        return None
    return _group(channel)


def build_group(comm: Communicator, largest: torch.Tensor) -> None:
    """Build the group of ``comm``'s allreduces now, with staging for messages up to the size of ``largest``, where
    shared memory would carry an allreduce of ``largest`` (collective over ``comm``), so that no non-blocking
    allreduce of that size builds or grows them later: both are collectives, and ranks may start their non-blocking
    operations at different moments (a rank that starts gradient buckets during backward while the others wait for
    it to say which parameters it used)."""
    if comm.size < 2 or not uses_shared_memory(largest, "avg", comm.size):
        return
    group = _group(comm.forward)
    if group is not None:
        group.hold_staging(largest.numel() * largest.element_size())


def _group(channel: MPI.Intracomm) -> SharedMemoryGroup | None:
    key = channel.py2f()
    if key in _groups:
        return _groups[key]
    with _lock:
        group = _groups[key] = SharedMemoryGroup.create(channel)
    return group


def built_group(channel: MPI.Intracomm) -> SharedMemoryGroup | None:
    """``channel``'s shared-memory group if it has been built (no communication)."""
    return _groups.get(channel.py2f())


def check_exchange(channel: MPI.Intracomm, tensor: object, op: str) -> Exchange | None:
    """How the argument check of an allreduce of ``tensor`` with ``op`` on ``channel`` combines its two values
    over the ranks, once the channel's shared-memory group exists (else ``None``: MPI's allreduce).

    Through the group's flags, woken by futexes, instead of an MPI allreduce whose busy-polling ranks wait for each
    other's time slices on a loaded node. When this rank's allreduce goes through the group too, the check is only
    posted here and compared by the allreduce once its input is copied in: the two waits become one.
    """
    group = built_group(channel)
    if group is None:
        return None
    if isinstance(tensor, torch.Tensor) and not tensor.is_meta and uses_shared_memory(tensor, op, group.size):
        return group.defer_check
    return group.exchange_check


def node_exchange(comm: Communicator) -> Exchange | None:
    """Where every op on ``comm`` checks its call besides MPI: the flags of the shared-memory group that its
    allreduces check through, once that group exists (so an allreduce and another op meet in one check)."""
    group = built_group(comm.forward)
    return None if group is None else group.exchange_check


check_on_node(node_exchange)


def buffer_ranks() -> MPI.Intracomm | None:
    """The ranks that share this machine, over which to allocate buffers that allreduces on node-local
    communicators read in place (the strategy's gradient buckets, see :func:`~mpistrategy.comm.shm_window.allocate`);
    ``None`` when shared memory is off, or in ``"auto"`` mode when this machine runs one rank. Collective over the
    world; ranks with different settings raise the same error."""
    require_alike(MPI.COMM_WORLD, False, "shared-memory buffers")
    machine = machine_comm()
    mode = shared_memory_mode()
    if mode == "off" or (mode == "auto" and machine.Get_size() == 1):
        return None
    return machine


def release(comm: Communicator) -> None:
    """Free the shared memory of ``comm``'s groups (collective over ``comm``; they are rebuilt when needed)."""
    for channel in (comm.forward, comm.backward):
        group = _groups.pop(channel.py2f(), None)
        if group is not None:
            group.close()


on_release(release)  # a freed communicator's groups go with it: MPI may give its channels' handles to new ones
