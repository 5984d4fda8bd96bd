"""Top-k sparsification with error feedback (Aji & Heafield 2017; Stich et al. 2018; Lin et al. 2018, DGC).

Per bucket of ``n`` elements and rank ``r``, with ``k = ceil(density * n)``::

    p_r = g_r + e_r                                   gradient plus residual
    I_r = indices of the k largest |p_r[i]|
    sent: the k pairs (i, p_r[i]), i in I_r           index int32 (int64 from 2**31 elements), value in the
                                                      bucket's dtype
    e_r <- p_r - sent                                 zero at I_r (up to the value's rounding to the bucket dtype)
    combined[i] = (1/P) sum_r sum_{j in I_r, j = i} p_r[j]      the mean of the P sparse vectors

The exchange is sparse: one allgather of every rank's k pairs (each rank picks its own indices, so they cannot be
summed on the wire); a rank's payload is ``k * (4 + itemsize)`` bytes (+ at most 14 bytes of alignment), against
``n * itemsize`` for the dense mean: 2% of it at density 1% in float32. The selection is biased (the largest
entries, not a random subset); error feedback (on by default) sends what was left out in later steps. A bucket
whose pairs would take at least as many bytes as its dense values (from density 0.5 in float32) is averaged
densely instead, which is exact: ``TopK(density=1)`` is the mean.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from mpistrategy.aggregation.base import GradBucket
from mpistrategy.aggregation.bits import WireFormat
from mpistrategy.aggregation.compression import working_dtype
from mpistrategy.aggregation.gathered import GatheredCompressor
from mpistrategy.aggregation.options import check_fraction


def selected_count(density: float, numel: int) -> int:
    """``k = ceil(density * n)``, at least 1 and at most ``n``."""
    return min(numel, max(1, math.ceil(density * numel)))


def index_dtype(numel: int) -> torch.dtype:
    """The narrowest index dtype for ``numel`` elements on the wire."""
    return torch.int32 if numel < 2**31 else torch.int64


def largest_magnitudes(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64) of the ``k`` entries of largest magnitude in the flat ``values``, in no particular order.

    Host tensors use NumPy's introselect (``argpartition``), 5-6x faster than ``torch.topk`` on a CPU for
    ``k`` = 1% of a million elements; device tensors use ``torch.topk``.
    """
    numel = values.numel()
    if k >= numel:
        return torch.arange(numel, device=values.device)
    magnitudes = values.abs()
    if values.is_cpu:
        chosen = np.argpartition(magnitudes.numpy(), numel - k)[numel - k :]
        return torch.from_numpy(chosen).to(torch.int64)
    return torch.topk(magnitudes, k, sorted=False).indices


class TopK(GatheredCompressor):
    """Send each bucket's ``density`` share of largest entries as (index, value) pairs; keep the rest as the
    residual (see the module docstring).

    Args:
        density: share of each bucket's elements sent, in (0, 1].
        error_feedback: keep what was not sent and add it to the next gradient (recommended).
    """

    scheme = "topk"

    def __init__(self, density: float = 0.01, error_feedback: bool = True) -> None:
        self.density = check_fraction(self.scheme, "density", density)
        super().__init__(error_feedback)

    @property
    def options(self) -> dict[str, Any]:
        return {"density": self.density, "error_feedback": self.error_feedback}

    def sends_dense(self, bucket: GradBucket) -> bool:
        numel, itemsize = bucket.buffer.numel(), bucket.buffer.element_size()
        pair = index_dtype(numel).itemsize + itemsize
        return selected_count(self.density, numel) * pair >= numel * itemsize

    def wire_format(self, bucket: GradBucket) -> WireFormat:
        numel = bucket.buffer.numel()
        k = selected_count(self.density, numel)
        return WireFormat.of(("indices", index_dtype(numel), k), ("values", bucket.buffer.dtype, k))

    def encode(self, values: torch.Tensor, bucket: GradBucket) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        numel = values.numel()
        indices = largest_magnitudes(values, selected_count(self.density, numel))
        sent = values[indices].to(bucket.buffer.dtype)
        parts = {"indices": indices.to(index_dtype(numel)), "values": sent}
        if not self.error_feedback:
            return parts, None
        values[indices] -= sent.to(values.dtype)
        return parts, values

    def combine(self, fields: dict[str, torch.Tensor], bucket: GradBucket) -> torch.Tensor:
        ranks = fields["values"].shape[0]
        combined = torch.zeros(
            bucket.buffer.numel(), dtype=working_dtype(bucket.buffer.dtype), device=bucket.buffer.device
        )
        combined.index_add_(
            0, fields["indices"].reshape(-1).to(torch.int64), fields["values"].reshape(-1).to(combined.dtype)
        )
        return combined.mul_(1.0 / ranks)
