"""signSGD with majority vote (Bernstein et al. 2019): every rank sends one bit per element, the signs are voted.

Per bucket and rank ``r``, with ``s_r = sign(g_r)`` (+1 or -1; sign(0) counted as +1)::

    sent: the sign bits (1 bit per element, packed), and with ``scaled`` the mean magnitude
          m_{r,k} = ||g_{r,k}||_1 / n_k of every parameter segment k
    vote_i = sign(sum_r s_{r,i}) in {-1, 0, +1}      the majority (0 on a tie, possible for an even number of ranks)
    combined_i = vote_i                              scaled=False: the paper's update direction
    combined_i = vote_i (1/P) sum_r m_{r,k}          scaled=True: the vote with the ranks' mean magnitude

The vote is robust (a minority of ranks cannot flip a sign) but biased and without error feedback (the vote is not
a sum of compressed vectors). With ``scaled=False`` the combined gradient has unit entries: use the small learning
rates of sign methods (or Adam); ``scaled=True`` (default) keeps SGD's learning rates meaningful at the cost of one
value per parameter. Only float gradients can be voted on; every rank computes the vote itself from the gathered
bits (one allgather per bucket of ``ceil(n / 8)`` bytes, + the scales and alignment).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mpistrategy.aggregation.base import GradBucket
from mpistrategy.aggregation.bits import WireFormat
from mpistrategy.aggregation.compression import working_dtype
from mpistrategy.aggregation.gathered import GatheredCompressor
from mpistrategy.aggregation.options import check_flag
from mpistrategy.aggregation.signs import mean_magnitudes, per_parameter, sign_bits, signs


class MajorityVote(GatheredCompressor):
    """signSGD with majority vote, optionally scaled by the ranks' mean magnitudes (see the module docstring).

    Args:
        scaled: multiply the vote by each parameter's mean gradient magnitude over the ranks (one value per
            parameter on the wire); ``False`` gives the plain vote, entries in {-1, 0, 1}.
    """

    scheme = "majority_vote"

    def __init__(self, scaled: bool = True) -> None:
        self.scaled = check_flag(self.scheme, "scaled", scaled)
        super().__init__(error_feedback=False)

    @property
    def options(self) -> dict[str, Any]:
        return {"scaled": self.scaled}

    def wire_format(self, bucket: GradBucket) -> WireFormat:
        numel = bucket.buffer.numel()
        scales = len(bucket.numels) if self.scaled else 0
        return WireFormat.of(
            ("scales", working_dtype(bucket.buffer.dtype), scales), ("signs", torch.uint8, math.ceil(numel / 8))
        )

    def encode(self, values: torch.Tensor, bucket: GradBucket) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        scales = mean_magnitudes(values, bucket) if self.scaled else values.new_zeros(0)
        return {"scales": scales, "signs": sign_bits(values)}, None

    def combine(self, fields: dict[str, torch.Tensor], bucket: GradBucket) -> torch.Tensor:
        dtype = working_dtype(bucket.buffer.dtype)
        votes = signs(fields["signs"], bucket.buffer.numel(), dtype).sum(0).sign_()
        if not self.scaled:
            return votes
        return votes.mul_(per_parameter(fields["scales"].mean(0), bucket))
