"""Where each shard lies: contiguous ranges of a flat parameter order, a pure function of the parameter sizes and
the number of shards.

A *space* is the parameters of one optimizer that share a dtype and device, concatenated in a fixed order into
``T`` elements. With ``N`` shards, shard ``r`` holds elements ``[b_r, b_{r+1})`` where ``b_r = floor(r T / N)``:
the shards differ by at most one element (at 3 ranks they are uneven), whatever the parameter sizes. A *piece* is
the part of one parameter inside one shard: a parameter lies in one shard, or is cut at shard boundaries into
pieces of consecutive elements (at most ``N - 1`` parameters are cut). Each piece is optimised as a parameter of
its own, so an optimizer keeps per-parameter state (Adam's step count, a parameter without a gradient that it
skips) exactly as it would for the whole parameter.

Buckets of a space (for reduce-scattering gradients) are runs of consecutive parameters, so that a bucket is a
contiguous range of the flat order too, and the part of it that shard ``r`` owns is one contiguous block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mpistrategy.collectives._layout import offsets


def shard_bounds(total: int, shards: int) -> list[int]:
    """``[b_0, ..., b_N]``: shard ``r`` holds elements ``[b_r, b_{r+1})`` of ``total`` (``b_r = floor(r T / N)``)."""
    if shards < 1:
        raise ValueError(f"shard_bounds: shards={shards} must be at least 1.")
    return [rank * total // shards for rank in range(shards + 1)]


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of parameter ``index`` of a space (in its flattened order), which begin at element
    ``offset`` of the space."""

    index: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def pieces_in(sizes: Sequence[int], start: int, stop: int) -> list[Piece]:
    """The pieces of the parameters of ``sizes`` that lie in elements ``[start, stop)`` of the flat order."""
    found = []
    for index, (offset, size) in enumerate(zip(offsets(sizes), sizes, strict=True)):
        low, high = max(start, offset), min(stop, offset + size)
        if low < high:
            found.append(Piece(index, low - offset, high - offset, low))
    return found


def shard_pieces(sizes: Sequence[int], shards: int, shard: int) -> list[Piece]:
    """The pieces of shard ``shard`` of ``shards`` over parameters of ``sizes`` elements."""
    bounds = shard_bounds(sum(sizes), shards)
    return pieces_in(sizes, bounds[shard], bounds[shard + 1])


def overlaps(bounds: Sequence[int], start: int, stop: int) -> list[int]:
    """How many elements of ``[start, stop)`` each shard of ``bounds`` (:func:`shard_bounds`) holds."""
    return [max(0, min(stop, high) - max(start, low)) for low, high in zip(bounds, bounds[1:], strict=False)]


@dataclass(frozen=True)
class BucketRange:
    """Parameters ``[first, last)`` of a space, elements ``[start, stop)`` of its flat order."""

    first: int
    last: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def bucket_ranges(sizes: Sequence[int], cap: int) -> list[BucketRange]:
    """Runs of consecutive parameters of at most ``cap`` elements each (a parameter larger than ``cap`` is a run of
    its own), in the flat order."""
    ranges: list[BucketRange] = []
    first, start, offset = 0, 0, 0
    for index, size in enumerate(sizes):
        if offset > start and offset + size - start > cap:
            ranges.append(BucketRange(first, index, start, offset))
            first, start = index, offset
        offset += size
    if offset > start or (sizes and not ranges):
        ranges.append(BucketRange(first, len(sizes), start, offset))
    return ranges
