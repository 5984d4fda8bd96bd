"""Where the tensors of a group's operations are: the shared segment a tensor lives in, and the chunks another
rank names by segment id and offset."""

from __future__ import annotations

import torch

from mpistrategy.comm.errors import CommunicationError
from mpistrategy.comm.shm_window import Segment, find, locate

_REMEMBERED_PLACES = 64


class Places:
    """The shared segments as the ranks of one group see them (``participants``: their world ranks).

    Remembers where tensors were found, by address and size, while the segment found is still allocated, and
    which segments every rank of the group takes part in: operations repeat on the same buffers."""

    def __init__(self, participants: tuple[int, ...]) -> None:
        self.participants = participants
        self._located: dict[tuple[int, int], tuple[Segment, int] | None] = {}
        self._covers: dict[int, bool] = {}

    def window_of(self, tensor: torch.Tensor) -> tuple[Segment, int] | None:
        """The segment that holds ``tensor`` in this process's part and that every rank of the group takes part
        in (so every rank can read it where it is), and the byte offset where it starts; else ``None``."""
        if not tensor.is_cpu:
            return None
        key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        where = self._located.get(key)
        if key not in self._located or (where is not None and find(where[0].id) is not where[0]):
            if len(self._located) >= _REMEMBERED_PLACES:
                self._located.clear()
            where = self._located[key] = locate(tensor) if tensor.is_contiguous() else None
        if where is None or not self._covered_by(where[0]):
            return None
        return where

    def _covered_by(self, segment: Segment) -> bool:
        covered = self._covers.get(segment.id)
        if covered is None:
            covered = self._covers[segment.id] = all(segment.index_of(p) is not None for p in self.participants)
        return covered

    def forget_segments(self) -> None:
        """Forget which segments the group covers (after the group's staging segment was replaced)."""
        self._covers.clear()

    def chunks_of(
        self, rank: int, segment_id: int, offset: int, numel: int, dtype: torch.dtype, step: int
    ) -> tuple[torch.Tensor, ...]:
        """Rank ``rank``'s ``numel`` elements of ``dtype`` at byte ``offset`` of segment ``segment_id``, in chunks
        of ``step`` elements; raises :class:`CommunicationError` if this rank does not share that segment."""
        segment = find(segment_id)
        index = segment.index_of(self.participants[rank]) if segment is not None else None
        if segment is None or index is None:
            raise CommunicationError(
                f"shared-memory allreduce: rank {rank} of the node names shared segment {segment_id}, which this "
                "rank does not share."
            )
        return segment.chunks(index, offset, numel, dtype, step)


def split(flat: torch.Tensor, step: int) -> tuple[torch.Tensor, ...]:
    """``flat`` in chunks of ``step`` elements (no call into torch for a single chunk)."""
    return (flat,) if flat.numel() <= step else flat.split(step)
