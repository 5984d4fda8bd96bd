"""The default aggregation: every rank gets the mean of all ranks' gradients (what DDP does)."""

from __future__ import annotations

import torch

from mpistrategy.aggregation.base import Aggregator, GradBucket, Work
from mpistrategy.collectives.reduction import iallreduce


class MeanAggregator(Aggregator):
    """Averages each bucket over all ranks with one non-blocking, in-place allreduce (``op="avg"``).

    With per-rank losses that are means over each rank's batch, the average of the gradients is the gradient of
    the mean loss over the global batch: training matches one process with the concatenated batch.
    """

    def start(self, bucket: GradBucket) -> Work:
        assert self.context is not None, "MeanAggregator.setup() was not called"
        self.context.sent(bucket.nbytes)
        with torch.no_grad():
            return iallreduce(bucket.buffer, "avg", self.context.comm, out=bucket.buffer)
