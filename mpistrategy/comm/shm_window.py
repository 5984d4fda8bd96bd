"""Memory that every rank of a node can address: MPI-3 shared windows as torch tensors.

A :class:`Segment` is one ``MPI.Win.Allocate_shared`` window over a communicator whose ranks share memory: every
rank owns ``nbytes`` of it (its *part*, page-aligned) and can read and write every other rank's part at plain
memory speed. :func:`allocate` creates one (collective over its communicator); :func:`locate` tells whether a
tensor lives in one of this process's parts, and where.

Segments carry an id that all their ranks agree on (the largest next id of the participants), so that ranks can
name a segment to each other ("my data is in segment 7 at byte 4096"); with the world ranks of its participants,
a rank can find any participant's copy of the same bytes. The memory comes from the MPI library (MPICH: a file
in ``/dev/shm``, mapped by every rank and unlinked at once); pages are allocated when first touched, and are
backed by huge pages only where ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` allows it.

Freeing is collective and unmaps the memory under every tensor that still refers to it, so :meth:`Segment.free`
first checks, on every rank, that nothing but the segment refers to its parts, and frees nothing otherwise.
"""

from __future__ import annotations

import bisect
import functools
import logging
import os
import threading

import torch
from mpi4py import MPI

from mpistrategy.comm.communicator import world_ranks
from mpistrategy.comm.references import HolderCheck

#: every part starts on a page boundary (and so on a cache line: no false sharing between ranks)
PAGE = 4096
_REMEMBERED_VIEWS = 512

_OWN_PART = HolderCheck(own_tensors=1)  # a segment keeps one tensor on each part's memory
#: where MPICH keeps shared windows (a tmpfs: its size bounds them)
SHM_DIRECTORY = "/dev/shm"

log = logging.getLogger(__name__)


@functools.cache
def machine_comm() -> MPI.Intracomm:
    """The ranks of the world that share memory with this process (collective over the world on first use)."""
    world = MPI.COMM_WORLD
    return world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())  # type: ignore[return-value]  # mpi4py: Comm


class Segment:
    """A shared window of ``nbytes`` per rank over ``comm`` (see the module docstring); built by :func:`allocate`.

    Attributes:
        id: the id every participant knows it by.
        comm: the communicator it was allocated over (freeing is collective over it).
        participants: the world rank of each of its ranks, in ``comm``'s order.
        nbytes: the bytes of every rank's part.
        rank: this process's index among the participants.
    """

    def __init__(self, segment_id: int, comm: MPI.Intracomm, nbytes: int, window: MPI.Win) -> None:
        self.id = segment_id
        self.comm = comm
        self.participants = world_ranks(comm)
        self.nbytes = nbytes
        self.rank = comm.Get_rank()
        self._window: MPI.Win | None = window  # None once freed
        self._index = {world_rank: index for index, world_rank in enumerate(self.participants)}
        self._parts = [self._part_of(rank) for rank in range(comm.Get_size())]
        self._storages = [part.untyped_storage() for part in self._parts]
        self._typed: dict[tuple, torch.Tensor] = {}
        self._chunked: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self.address = self._parts[self.rank].data_ptr()

    def _part_of(self, rank: int) -> torch.Tensor:
        assert self._window is not None
        memory, _ = self._window.Shared_query(rank)
        start = -memory.address % PAGE
        return torch.frombuffer(memory, dtype=torch.uint8, count=self.nbytes, offset=start)

    def part(self, index: int) -> torch.Tensor:
        """Participant ``index``'s bytes (uint8), as a tensor this process can read and write."""
        return self._parts[index]

    def index_of(self, world_rank: int) -> int | None:
        """The participant index of the process with this world rank, or ``None`` if it is not a participant."""
        return self._index.get(world_rank)

    def typed(self, index: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of ``dtype`` at byte ``offset`` of participant ``index``'s part (a flat view, the
        same tensor for the same arguments while the segment remembers it)."""
        key = (index, offset, numel, dtype)
        found = self._typed.get(key)
        if found is None:
            self._forget_views_if_full()
            found = self._typed[key] = self._parts[index][offset : offset + numel * dtype.itemsize].view(dtype)
        return found

    def chunks(self, index: int, offset: int, numel: int, dtype: torch.dtype, step: int) -> tuple[torch.Tensor, ...]:
        """:meth:`typed` split into consecutive chunks of ``step`` elements (remembered too: operations that
        repeat reuse them instead of slicing anew)."""
        key = (index, offset, numel, dtype, step)
        found = self._chunked.get(key)
        if found is None:
            self._forget_views_if_full()
            found = self._chunked[key] = self.typed(index, offset, numel, dtype).split(step)
        return found

    def _forget_views_if_full(self) -> None:
        if len(self._typed) + len(self._chunked) >= _REMEMBERED_VIEWS:
            self._typed.clear()
            self._chunked.clear()

    def fence(self) -> None:
        """A full memory fence for loads and stores in shared memory (``MPI_Win_sync``)."""
        assert self._window is not None, "fence on a freed segment"
        self._window.Sync()

    def in_use(self) -> bool:
        """Whether something other than the segment's own parts (a tensor, a view, an array, a Python storage
        object) refers to its memory in this process."""
        return any(_OWN_PART.held_elsewhere(self._storages, index) for index in range(len(self._storages)))

    def free(self) -> bool:
        """Collective over ``comm``: free the window unless some rank still has tensors on it (then nothing is
        freed and every rank returns False)."""
        if self._window is None:
            return True
        self._typed.clear()
        self._chunked.clear()
        busy = self.comm.allreduce(self.in_use(), op=MPI.LOR)
        if busy:
            return False
        with _lock:
            _forget(self)
        self._parts, self._storages = [], []
        self._window.Unlock_all()
        self._window.Free()
        self._window = None
        return True

    def __repr__(self) -> str:
        return f"Segment(id={self.id}, {self.nbytes} bytes per rank, {len(self.participants)} ranks)"


_lock = threading.Lock()
_next_id = 0
_by_address: list[tuple[int, Segment]] = []  # (this process's part address, segment), sorted
_by_id: dict[int, Segment] = {}


def allocate(nbytes: int, comm: MPI.Intracomm) -> Segment:
    """A new :class:`Segment` of ``nbytes`` per rank over ``comm``, whose ranks must share memory.

    Collective over ``comm``. Every rank may ask for a different size; each part is rounded up to whole pages.
    """
    global _next_id
    nbytes = -(-max(int(nbytes), 1) // PAGE) * PAGE
    with _lock:
        segment_id = comm.allreduce(_next_id, op=MPI.MAX)
        _next_id = segment_id + 1
    info = MPI.Info.Create()
    info.Set("alloc_shared_noncontig", "true")
    try:
        window = MPI.Win.Allocate_shared(nbytes + PAGE, 1, info=info, comm=comm)
    finally:
        info.Free()
    window.Lock_all(MPI.MODE_NOCHECK)  # a passive epoch, in which Win_sync is a memory fence
    segment = Segment(segment_id, comm, nbytes, window)
    with _lock:
        bisect.insort(_by_address, (segment.address, segment), key=lambda item: item[0])
        _by_id[segment_id] = segment
    return segment


def room_for(nbytes: int, comm: MPI.Intracomm, what: str) -> bool:
    """Whether ``SHM_DIRECTORY`` has room for ``nbytes`` per rank of ``comm`` beside what is in it now, on every
    rank (collective over ``comm``). Touching a page of a shared window beyond a full tmpfs kills the process
    (SIGBUS), as in a container that keeps the 64 MB default: where there is no room, ``what`` is said and the
    caller uses private memory."""
    try:
        stats = os.statvfs(SHM_DIRECTORY)
        free = stats.f_bavail * stats.f_frsize
    except OSError:
        free = None
    need = nbytes * comm.Get_size()
    fits = comm.allreduce(free is None or need <= free, op=MPI.LAND)
    if not fits and comm.Get_rank() == 0:
        log.warning(
            "%s: %.0f MB of shared memory do not fit in %s (%.0f MB free); using private memory instead (slower "
            "within a node). Give the job a larger %s (docker: --shm-size).",
            what,
            need / 2**20,
            SHM_DIRECTORY,
            (free or 0) / 2**20,
            SHM_DIRECTORY,
        )
    return fits


def find(segment_id: int) -> Segment | None:
    """This process's segment with id ``segment_id``, if it takes part in one."""
    return _by_id.get(segment_id)


def _forget(segment: Segment) -> None:
    _by_address[:] = [(address, s) for address, s in _by_address if s is not segment]
    _by_id.pop(segment.id, None)


def locate(tensor: torch.Tensor) -> tuple[Segment, int] | None:
    """The segment whose part in this process holds all of ``tensor``'s memory and the byte offset where it
    starts, or ``None`` (not contiguous, not on the CPU, or not in shared memory)."""
    if not _by_address or not tensor.is_cpu or not tensor.is_contiguous():
        return None
    start = tensor.data_ptr()
    position = bisect.bisect_right(_by_address, start, key=lambda item: item[0]) - 1
    if position < 0:
        return None
    address, segment = _by_address[position]
    offset = start - address
    if offset + tensor.numel() * tensor.element_size() > segment.nbytes:
        return None
    return segment, offset
