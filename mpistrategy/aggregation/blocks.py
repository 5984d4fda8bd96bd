"""Fixed-size blocks of a flat bucket, for quantisers that keep one scale (a norm, a range) per block.

A bucket of ``n`` elements is cut into ``ceil(n / block_size)`` consecutive blocks; the last may be shorter and is
padded for the vectorised computation (with zeros, or with its own last element where zeros would change the
block's statistic, as for a minimum and maximum).
"""

from __future__ import annotations

import torch


def block_count(numel: int, block_size: int) -> int:
    """How many blocks of ``block_size`` cover ``numel`` elements."""
    return -(-numel // block_size)


def as_blocks(values: torch.Tensor, block_size: int, pad_with_last: bool = False) -> torch.Tensor:
    """The flat ``values`` as a ``(blocks, block_size)`` tensor, the last block padded with zeros (or with the
    last element)."""
    missing = -values.numel() % block_size
    if missing:
        fill = values[-1:].expand(missing) if pad_with_last else values.new_zeros(missing)
        values = torch.cat([values, fill])
    return values.view(-1, block_size)


def as_padded_blocks(codes: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """One rank's flat per-element codes as ``(blocks, block_size)`` in ``dtype``, the last block padded with
    zeros (decoded padding is cut off by :func:`flat`)."""
    return as_blocks(codes.to(dtype), block_size)


def flat(blocks: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` elements of ``(blocks, block_size)`` values: the bucket without the padding."""
    return blocks.reshape(-1)[:numel]
