"""Min-max quantisation to ``bits`` bits per element (8 by default), with error feedback (as Bagua's ByteGrad).

Per block of ``block_size`` consecutive elements ``v`` of a bucket (the last block may be shorter) and rank, with
``p = g + e`` (error feedback) and ``L = 2**bits - 1``::

    lo = min(p), hi = max(p)                        sent, one pair per block, in the working dtype
    step = (hi - lo) / L
    c_i = round((p_i - lo) / step) in [0, L]        sent as ``bits``-bit codes, packed
    decoded: p^_i = lo + c_i step,  |p_i - p^_i| <= step / 2    (one step is the quantisation error bound)
    e <- p - p^

Rounding to the nearest level is biased; error feedback (on by default) sends the rounding errors in later steps.
A block whose values are all equal (``step = 0``) is sent exactly. The combined bucket is the mean over ranks of the
decoded vectors. Each rank's grid differs, so the messages are gathered (one allgather per bucket): a rank sends
``ceil(n * bits / 8) + 2 * ceil(n / block_size) * itemsize`` bytes (8 bits, blocks of 1024, float32: 25.2% of the
dense mean's bytes).
"""

from __future__ import annotations

from typing import Any

import torch

from mpistrategy.aggregation.base import GradBucket
from mpistrategy.aggregation.bits import WireFormat, pack_bits, packed_nbytes, unpack_bits
from mpistrategy.aggregation.blocks import as_blocks, as_padded_blocks, block_count, flat
from mpistrategy.aggregation.compression import working_dtype
from mpistrategy.aggregation.gathered import GatheredCompressor
from mpistrategy.aggregation.options import check_integer


class MinMaxQuantization(GatheredCompressor):
    """Quantise each block to ``bits`` bits on its own [min, max] range (see the module docstring).

    Args:
        bits: bits per element, 1 to 8.
        block_size: elements per (min, max) pair.
        error_feedback: keep the rounding error and add it to the next gradient (recommended).
    """

    scheme = "minmax"

    def __init__(self, bits: int = 8, block_size: int = 1024, error_feedback: bool = True) -> None:
        self.bits = check_integer(self.scheme, "bits", bits, 1, 8, "bits per element")
        self.block_size = check_integer(self.scheme, "block_size", block_size, 1, meaning="elements per range")
        super().__init__(error_feedback)
        self.top = (1 << self.bits) - 1

    @property
    def options(self) -> dict[str, Any]:
        return {"bits": self.bits, "block_size": self.block_size, "error_feedback": self.error_feedback}

    def wire_format(self, bucket: GradBucket) -> WireFormat:
        numel = bucket.buffer.numel()
        dtype = working_dtype(bucket.buffer.dtype)
        count = block_count(numel, self.block_size)
        return WireFormat.of(
            ("low", dtype, count), ("high", dtype, count), ("codes", torch.uint8, packed_nbytes(numel, self.bits))
        )

    def encode(self, values: torch.Tensor, bucket: GradBucket) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        blocks = as_blocks(values, self.block_size, pad_with_last=True)
        low, high = torch.aminmax(blocks, dim=1)
        step = (high - low) / self.top
        inverse = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
        codes = (blocks - low[:, None]).mul_(inverse[:, None]).round_().clamp_(0, self.top)
        parts = {"low": low, "high": high, "codes": pack_bits(flat(codes, values.numel()).to(torch.uint8), self.bits)}
        if not self.error_feedback:
            return parts, None
        decoded = torch.addcmul(low[:, None], codes, step[:, None])
        return parts, values.sub_(flat(decoded, values.numel()))

    def combine(self, fields: dict[str, torch.Tensor], bucket: GradBucket) -> torch.Tensor:
        numel = bucket.buffer.numel()
        low, high = fields["low"], fields["high"]
        steps = (high - low) / self.top
        codes = unpack_bits(fields["codes"], self.bits, numel)
        combined = torch.zeros(low.shape[1], self.block_size, dtype=low.dtype, device=low.device)
        for rank in range(low.shape[0]):
            combined.add_(low[rank][:, None])
            combined.addcmul_(as_padded_blocks(codes[rank], self.block_size, low.dtype), steps[rank][:, None])
        return flat(combined, numel).mul_(1.0 / low.shape[0])
