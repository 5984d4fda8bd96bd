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


def per_element(per_block: torch.Tensor, block_size: int, numel: int) -> torch.Tensor:
    """Each block's value repeated over its elements: ``(..., blocks)`` -> ``(..., numel)``."""
    return per_block.repeat_interleave(block_size, dim=-1)[..., :numel]
