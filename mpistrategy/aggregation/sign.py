"""Scaled sign compression with error feedback: EF-SignSGD (Karimireddy et al. 2019).

Per bucket, rank and parameter segment ``s`` (``n_s`` elements) of the bucket, with ``p = g + e``::

    m_s = ||p_s||_1 / n_s                            the mean magnitude, one per parameter, in the working dtype
    C(p)_i = m_s sign(p_i)                           sign(0) counted as +1
    sent: the sign bits (1 bit per element, packed) and the m_s
    e <- p - C(p)
    combined = (1/P) sum_r C(p_r)

Plain signSGD can diverge and is biased; with error feedback the scaled sign converges at SGD's rate (the paper's
Theorem II). A rank's payload is ``ceil(n / 8) + itemsize * parameters`` bytes (+ alignment): 1/32 of float32's
bytes plus a few bytes per parameter. Each rank's scales differ, so the messages are gathered (one allgather per
bucket).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mpistrategy.aggregation.base import GradBucket
from mpistrategy.aggregation.bits import WireFormat
from mpistrategy.aggregation.compression import working_dtype
from mpistrategy.aggregation.gathered import GatheredCompressor
from mpistrategy.aggregation.signs import mean_magnitudes, per_parameter, sign_bits, signs, unit_signs


class ScaledSign(GatheredCompressor):
    """Send each parameter's gradient as its signs and its mean magnitude, with error feedback (see the module
    docstring).

    Args:
        error_feedback: keep ``p - C(p)`` and add it to the next gradient (recommended; without it the scaled sign
            is biased and may not converge).
    """

    scheme = "sign"

    def __init__(self, error_feedback: bool = True) -> None:
        super().__init__(error_feedback)

    @property
    def options(self) -> dict[str, Any]:
        return {"error_feedback": self.error_feedback}

    def wire_format(self, bucket: GradBucket) -> WireFormat:
        numel = bucket.buffer.numel()
        dtype = working_dtype(bucket.buffer.dtype)
        return WireFormat.of(("scales", dtype, len(bucket.numels)), ("signs", torch.uint8, math.ceil(numel / 8)))

    def encode(self, values: torch.Tensor, bucket: GradBucket) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        scales = mean_magnitudes(values, bucket)
        parts = {"scales": scales, "signs": sign_bits(values)}
        if not self.error_feedback:
            return parts, None
        return parts, values.sub_(unit_signs(values).mul_(per_parameter(scales, bucket)))

    def combine(self, fields: dict[str, torch.Tensor], bucket: GradBucket) -> torch.Tensor:
        scales = fields["scales"]
        directions = signs(fields["signs"], bucket.buffer.numel(), scales.dtype)
        combined = torch.zeros_like(directions[0])
        for rank in range(scales.shape[0]):
            combined.addcmul_(directions[rank], per_parameter(scales[rank], bucket))
        return combined.mul_(1.0 / scales.shape[0])
