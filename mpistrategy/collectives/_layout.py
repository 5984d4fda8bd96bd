"""Moving the communicated dimension to the front, where MPI's contiguous blocks are."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_front(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """``tensor`` with ``dim`` moved first, contiguous (a copy only when ``dim`` is not already first). Lazy
    conjugate and negative bits stay: the buffers MPI reads apply them (:func:`~mpistrategy.comm.buffers.on_wire`)."""
    return tensor.movedim(dim, 0).contiguous() if dim else tensor.contiguous()


def from_front(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Undo :func:`to_front`: move the first dimension back to position ``dim``."""
    return tensor.movedim(0, dim) if dim else tensor


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal sizes, the first ones larger (as ``torch.tensor_split``)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def offsets(sizes: Sequence[int]) -> list[int]:
    """Exclusive prefix sums of ``sizes``: where each block starts."""
    starts, position = [], 0
    for size in sizes:
        starts.append(position)
        position += size
    return starts
