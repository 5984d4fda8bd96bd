"""QSGD: unbiased stochastic quantisation to ``s`` levels per sign (Alistarh et al. 2017).

Per block of ``d = block_size`` consecutive elements ``v`` of a bucket (the last block may be shorter) and rank::

    nu = ||v||_2                                      one norm per block, in the working dtype
    a_i = s |v_i| / nu in [0, s],  l_i = floor(a_i)
    xi_i = l_i + 1 with probability a_i - l_i, else l_i         stochastic rounding (a generator per rank)
    q_i = sign(v_i) xi_i in {-s, ..., s}              sent as the code q_i + s in ceil(log2(2s + 1)) bits, packed
    decoded: v^_i = nu q_i / s

``E[xi_i] = a_i``, so ``E[v^_i] = v_i``: the quantiser is unbiased, with variance at most
``min(d / s**2, sqrt(d) / s) ||v||**2`` per block (the paper's Lemma 3.1), which is why blocks are small. The
combined bucket is the mean over ranks of the decoded vectors, ``(1/P) sum_r v^_r``, an unbiased estimate of the
mean gradient; no error feedback is needed. Each rank's codes and norms differ, so they are gathered (one allgather
per bucket): a rank sends ``ceil(n * bits / 8) + ceil(n / d) * itemsize`` bytes (``levels=127``: 8 bits; with the
norms at ``d = 512``, 25.2% of float32's bytes). Each rank's rounding generator (seeded from ``seed`` and
its world rank) is part of the checkpoint.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from mpistrategy.aggregation.base import AggregationContext, GradBucket
from mpistrategy.aggregation.bits import WireFormat, pack_bits, packed_nbytes, unpack_bits
from mpistrategy.aggregation.blocks import as_blocks, as_padded_blocks, block_count, flat
from mpistrategy.aggregation.compression import working_dtype
from mpistrategy.aggregation.gathered import GatheredCompressor
from mpistrategy.aggregation.options import check_integer

MAX_LEVELS = 127


def rank_seed(seed: int, rank: int) -> int:
    """A 63-bit seed for ``rank``'s generator, derived from ``seed`` (independent streams for different ranks)."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def code_width(levels: int) -> int:
    """Bits per element: codes ``q + s`` take ``2s + 1`` values."""
    return math.ceil(math.log2(2 * levels + 1))


class QSGD(GatheredCompressor):
    """Unbiased stochastic quantisation of each block to ``levels`` levels per sign (see the module docstring).

    Args:
        levels: ``s``, quantisation levels per sign, 1 to 127 (``bits = ceil(log2(2s + 1))`` per element: 1 -> 2
            bits, 7 -> 4 bits, 127 -> 8 bits).
        block_size: elements per norm (the paper's bucket size ``d``); smaller blocks, less variance.
        seed: seed of the per-rank rounding generators (combined with the world rank).
    """

    scheme = "qsgd"

    def __init__(self, levels: int = 127, block_size: int = 512, seed: int = 0) -> None:
        self.levels = check_integer(self.scheme, "levels", levels, 1, MAX_LEVELS, "quantisation levels per sign")
        self.block_size = check_integer(self.scheme, "block_size", block_size, 1, meaning="elements per norm")
        self.seed = check_integer(self.scheme, "seed", seed, 0)
        super().__init__(error_feedback=False)
        self.width = code_width(self.levels)
        self.generator: torch.Generator | None = None

    @property
    def options(self) -> dict[str, Any]:
        return {"levels": self.levels, "block_size": self.block_size, "seed": self.seed}

    def setup(self, context: AggregationContext) -> None:
        if self.generator is None:
            self.generator = torch.Generator().manual_seed(rank_seed(self.seed, context.topology.rank))
        super().setup(context)

    def wire_format(self, bucket: GradBucket) -> WireFormat:
        numel = bucket.buffer.numel()
        return WireFormat.of(
            ("norms", working_dtype(bucket.buffer.dtype), block_count(numel, self.block_size)),
            ("codes", torch.uint8, packed_nbytes(numel, self.width)),
        )

    def encode(self, values: torch.Tensor, bucket: GradBucket) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        blocks = as_blocks(values, self.block_size)
        norms = torch.linalg.vector_norm(blocks, dim=1)
        scale = torch.where(norms > 0, self.levels / norms, torch.zeros_like(norms))
        fractions = blocks.abs().mul_(scale[:, None]).clamp_(max=self.levels)  # a_i, in [0, s]
        lower = fractions.floor()
        draws = torch.rand(blocks.shape, generator=self.generator, dtype=blocks.dtype).to(blocks.device)
        rounded = (draws < fractions.sub_(lower)).to(blocks.dtype).add_(lower)  # xi_i
        codes = torch.copysign(rounded, blocks).add_(self.levels).to(torch.uint8)  # -0 levels: code s, as +0
        return {"norms": norms, "codes": pack_bits(flat(codes, values.numel()), self.width)}, None

    def combine(self, fields: dict[str, torch.Tensor], bucket: GradBucket) -> torch.Tensor:
        numel = bucket.buffer.numel()
        norms = fields["norms"]
        codes = unpack_bits(fields["codes"], self.width, numel)
        combined = torch.zeros(norms.shape[1], self.block_size, dtype=norms.dtype, device=norms.device)
        for rank in range(norms.shape[0]):
            levels = as_padded_blocks(codes[rank], self.block_size, norms.dtype).sub_(self.levels)
            combined.addcmul_(levels, norms[rank][:, None])
        return flat(combined, numel).mul_(1.0 / (self.levels * norms.shape[0]))

    @property
    def has_state(self) -> bool:
        return True

    def rank_state(self) -> dict[str, Any]:
        assert self.generator is not None
        return {"generator": self.generator.get_state()}

    def load_rank_state(self, state: dict[str, Any]) -> None:
        assert self.generator is not None
        self.generator.set_state(state["generator"])
