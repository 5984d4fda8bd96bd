"""The default sync mode: every step, every gradient bucket is averaged over all ranks (DDP's data parallelism).

``g <- (1/P) sum_r g_r`` for every bucket, by the user's aggregator (the mean, or a compressing scheme) over the
world's gradient communicator. Parameters are never averaged: starting from the same values (rank 0's, broadcast
at setup) and applying the same averaged gradients, every rank keeps the same parameters.
"""

from __future__ import annotations

from mpistrategy.aggregation.base import Aggregator, GradBucket
from mpistrategy.sync.base import SyncMode


class FlatSync(SyncMode):
    """Every step: the user's aggregator over all ranks."""

    name = "flat"

    def setup_buckets(self, buckets: list[GradBucket]) -> None:
        ctx = self.ctx
        spans_nodes = ctx.topology.num_nodes > 1
        ctx.aggregator.setup(self.aggregation_context(buckets, ctx.topology.gradients, spans_nodes))

    def gradient_aggregator(self) -> Aggregator:
        return self.ctx.aggregator
