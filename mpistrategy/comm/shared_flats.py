"""Flat buffers in a node's shared memory that every rank of the node reads in place.

:class:`SharedFlats` lays out ``sets`` copies of a list of flat buffers (one ``(dtype, numel)`` each) in every
rank's part of one :class:`~mpistrategy.comm.shm_window.Segment`, each buffer on a cache line. :meth:`own` is this
rank's set ``k``, :meth:`of` rank ``r``'s: a rank that needs another's result reads it where it is, so a broadcast
inside the node becomes a barrier. When a set may be overwritten (every reader is done with it) is the caller's
business; two sets used in turn let one be read while the next is written.

Memory: ``sets`` times the buffers' bytes per rank, in ``/dev/shm`` (pages allocated when first touched).
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from mpistrategy.comm.shm_window import Segment, allocate

_ALIGN = 64  # bytes: every buffer starts on a cache line


class SharedFlats:
    """``sets`` sets of flat buffers of ``layout`` (``(dtype, numel)`` per buffer) per rank of ``comm``, whose
    ranks must share memory. Collective over ``comm`` to build and to :meth:`free`."""

    def __init__(self, comm: MPI.Intracomm, layout: list[tuple[torch.dtype, int]], sets: int = 2) -> None:
        self.layout = list(layout)
        self.sets = sets
        self._offsets: list[list[int]] = []
        end = 0
        for _ in range(sets):
            row = []
            for dtype, numel in self.layout:
                start = -(-end // _ALIGN) * _ALIGN
                row.append(start)
                end = start + numel * dtype.itemsize
            self._offsets.append(row)
        self.rank = comm.Get_rank()
        self.segment: Segment | None = allocate(end, comm)

    def of(self, rank: int, index: int) -> list[torch.Tensor]:
        """Rank ``rank``'s buffers of set ``index`` (views this process can read and write)."""
        segment = self.segment
        if segment is None:
            raise RuntimeError("SharedFlats: used after free().")
        offsets = self._offsets[index % self.sets]
        return [
            segment.typed(rank, offset, numel, dtype)
            for offset, (dtype, numel) in zip(offsets, self.layout, strict=True)
        ]

    def own(self, index: int) -> list[torch.Tensor]:
        """This rank's buffers of set ``index``."""
        return self.of(self.rank, index)

    def free(self) -> bool:
        """Collective: free the shared memory unless a tensor still refers to it (then keep it; False)."""
        if self.segment is None:
            return True
        freed = self.segment.free()
        if freed:
            self.segment = None
        return freed
