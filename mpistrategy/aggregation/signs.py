"""Sign bits and per-parameter magnitudes, shared by the sign schemes (scaled sign, majority vote).

On the wire a sign is one bit, 1 for ``v >= 0`` and 0 for ``v < 0`` (zero counts as positive, so that one bit
suffices), packed eight to a byte by :func:`~mpistrategy.aggregation.bits.pack_bits`. Magnitudes are kept per
parameter (a segment of the flat bucket), as the sign methods' papers scale per layer.
"""

from __future__ import annotations

import torch

from mpistrategy.aggregation.base import GradBucket
from mpistrategy.aggregation.bits import pack_bits, unpack_bits


def sign_bits(values: torch.Tensor) -> torch.Tensor:
    """The packed sign bits of the flat ``values`` (``ceil(n / 8)`` bytes)."""
    return pack_bits(values >= 0, 1)


def unit_signs(values: torch.Tensor) -> torch.Tensor:
    """The signs the bits of :func:`sign_bits` stand for: +1 where ``values >= 0``, else -1, in ``values``' dtype."""
    return (values >= 0).to(values.dtype).mul_(2).sub_(1)


def signs(streams: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The signs (+1 or -1, in ``dtype``) encoded in packed sign bits: ``(..., nbytes)`` -> ``(..., numel)``."""
    return unpack_bits(streams, 1, numel).to(dtype).mul_(2).sub_(1)


def mean_magnitudes(values: torch.Tensor, bucket: GradBucket) -> torch.Tensor:
    """``||v_s||_1 / n_s`` for every parameter segment ``s`` of the bucket (one value per parameter)."""
    return torch.stack([segment.abs().mean() for segment in values.split(bucket.numels)])


def per_parameter(scales: torch.Tensor, bucket: GradBucket) -> torch.Tensor:
    """Each parameter's value repeated over its segment: ``(parameters,)`` -> ``(numel,)``."""
    return torch.cat([scale.expand(numel) for scale, numel in zip(scales, bucket.numels, strict=True)])
