"""Low-precision averaging: gradients cast to float16 or bfloat16, averaged, cast back (torch's fp16/bf16 hooks).

Per bucket and rank, with ``w`` the wire dtype::

    sent: h_r = cast_w(g_r / P)                       divided before the cast, so the sum cannot overflow
    combined = cast_back(sum_r h_r)                   summed on the wire as 2-byte values (an MPI operation that
                                                      adds pairs and rounds once per addition, as NCCL does)

Dividing first keeps the sum of ``P`` values as large as the largest one: float16 (max 65504) overflows only where
a single rank's gradient times ``1/P`` already does. float16 keeps 11 significant bits over a narrow range,
bfloat16 8 bits over float32's range. A rank's payload is ``n * 2`` bytes, half of float32's; the relative error of
the result is about ``(log2(P) + 1) * 2**-11`` (float16) or ``2**-8`` (bfloat16) per element.

A bucket whose dtype is not wider than ``w`` is sent in its own dtype (a float32 bucket with ``dtype="float32"``, a
bfloat16 bucket with either half type): no cast, so ``LowPrecision("float32")`` on float32 gradients is exactly
the mean, and ``"float32"`` compresses float64 gradients.
"""

from __future__ import annotations

from typing import Any

import torch

from mpistrategy.aggregation.base import GradBucket
from mpistrategy.aggregation.compression import CompressingAggregator, InFlight
from mpistrategy.aggregation.options import check_choice
from mpistrategy.aggregation.wire import HALF_DTYPES, start_sum

WIRE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class LowPrecision(CompressingAggregator):
    """Average every bucket in a narrower floating-point type on the wire (see the module docstring).

    Args:
        dtype: the wire dtype, ``"float16"``, ``"bfloat16"`` or ``"float32"``.
    """

    scheme = "low_precision"

    def __init__(self, dtype: str = "float16") -> None:
        self.dtype = check_choice(self.scheme, "dtype", dtype, WIRE_DTYPES)
        super().__init__(error_feedback=False)

    @property
    def options(self) -> dict[str, Any]:
        return {"dtype": self.dtype}

    def wire_dtype(self, bucket: GradBucket) -> torch.dtype:
        """The dtype ``bucket`` travels in: the configured one, unless the bucket's own is not wider."""
        wire, own = WIRE_DTYPES[self.dtype], bucket.buffer.dtype
        return own if own.itemsize <= wire.itemsize else wire

    def start(self, bucket: GradBucket) -> InFlight:
        wire = self.wire_dtype(bucket)
        if wire not in HALF_DTYPES and wire == bucket.buffer.dtype:
            return self.start_mean(bucket)
        assert self.context is not None
        ranks = self.context.comm.size
        if wire == bucket.buffer.dtype:  # half-precision gradients summed as they are, in place
            shares = bucket.buffer.mul_(1.0 / ranks)
        else:
            shares = (bucket.buffer * (1.0 / ranks)).to(wire)
        self.sent(shares.nbytes)

        def complete(total: torch.Tensor) -> None:
            if total is not bucket.buffer:
                bucket.buffer.copy_(total)

        return InFlight(start_sum(self.context.comm, shares), complete)
