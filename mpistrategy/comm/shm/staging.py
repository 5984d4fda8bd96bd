"""Staging: the shared memory where a rank puts an input that the others cannot read where it is (and where an
owner puts the sums of an input that must stay as it is).

One segment per group, handed out as a ring. Every operation reserves its size, whether or not this rank copies
in, so that every rank reserves the same offsets and decides alike, at the same operation, to grow the segment
(a collective): when the space of one of the last :data:`STAGING_DEPTH` operations would be reused. Older space is
reused, once its operation is done on every rank if this one writes there. The segment starts at the first
message and doubles when it grows; its pages are allocated when first touched.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch
from mpi4py import MPI

from mpistrategy.comm.shm_flags import RING
from mpistrategy.comm.shm_window import Segment, allocate

#: bytes: every reservation starts on a page
STAGING_ALIGN = 4096
#: the space of this many latest operations is never reused: the segment grows instead
STAGING_DEPTH = 2


class Staging:
    """The staging segment of one group over ``comm`` (collective over ``comm`` to grow and to free).

    Args:
        comm: the ranks of the group.
        before_growing: called on every rank before the segment is replaced: it must complete every operation
            that may use it, on every rank.
    """

    def __init__(self, comm: MPI.Intracomm, before_growing: Callable[[], None]) -> None:
        self.segment: Segment | None = None
        self._comm = comm
        self._before_growing = before_growing
        self._regions: collections.deque[tuple[int, int, int]] = collections.deque()  # (seq, start, end)
        self._head = 0  # where the next reservation starts
        self._before_last: tuple[tuple[tuple[int, int, int], ...], int] = ((), 0)

    def reserve(self, seq: int, nbytes: int) -> tuple[tuple[int, int], int]:
        """Reserve ``nbytes`` for operation ``seq``: where (segment id and byte offset, as the other ranks find
        it), and the last operation that used any of that space (0: none), which every rank must have completed
        before this one writes there. Operations up to ``seq - RING`` must be complete on every rank."""
        self._before_last = (tuple(self._regions), self._head)
        need = -(-nbytes // STAGING_ALIGN) * STAGING_ALIGN
        while self._regions and self._regions[0][0] <= seq - RING:
            self._regions.popleft()
        while True:
            capacity = self.segment.nbytes if self.segment is not None else 0
            start = self._head if self._head + need <= capacity else 0
            end = start + need
            busy_until, kept = 0, []
            for region in self._regions:
                if region[1] < end and start < region[2]:
                    busy_until = max(busy_until, region[0])
                else:
                    kept.append(region)
            if end <= capacity and (not busy_until or seq - busy_until >= STAGING_DEPTH):
                break
            self._grow(max(need, 2 * capacity))
        kept.append((seq, start, end))
        self._regions = collections.deque(kept)
        self._head = end
        assert self.segment is not None, "the loop above allocates the segment"
        return (self.segment.id, start), busy_until

    def hold(self, nbytes: int) -> None:
        """Grow now, if needed, so that operations of up to ``nbytes`` each never grow the segment (collective, with
        no operation in flight): a reservation grows it only when it would overlap the last operation's space,
        which three times the largest operation's space rules out."""
        need = 3 * (-(-nbytes // STAGING_ALIGN) * STAGING_ALIGN)
        if (self.segment.nbytes if self.segment is not None else 0) < need:
            self._grow(need)

    def undo_last(self) -> None:
        """Return the space of the last reservation (its operation was dropped on every rank)."""
        regions, self._head = self._before_last
        self._regions = collections.deque(regions)

    def chunks(self, offset: int, numel: int, dtype: torch.dtype, step: int) -> tuple[torch.Tensor, ...]:
        """This rank's ``numel`` elements of ``dtype`` at ``offset``, in chunks of ``step`` elements."""
        assert self.segment is not None, "reserve() allocates the segment"
        return self.segment.chunks(self.segment.rank, offset, numel, dtype, step)

    def _grow(self, capacity: int) -> None:
        """Replace the segment by one of ``capacity`` bytes (collective: every rank grows at the same operation)."""
        self._before_growing()
        self.free()
        self.segment = allocate(capacity, self._comm)
        self._regions.clear()
        self._head = 0

    def free(self) -> None:
        """Collective: free the segment."""
        if self.segment is not None:
            self.segment.free()
            self.segment = None
