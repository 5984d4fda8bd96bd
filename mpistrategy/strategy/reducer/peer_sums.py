"""CUDA buckets averaged on the GPU that the ranks share, through each other's device memory.

Where every rank runs on one machine and one GPU (several ranks per GPU) and the aggregator is the mean, the
buckets are averaged by a :class:`~mpistrategy.comm.cuda_ipc.PeerDeviceGroup` over them: no host memory, no
copies across the bus, no MPI message but the fences' barriers. The average is
``g <- (1/P) sum_r g_r`` as the mean aggregator gives it (sum in rank order, then divided by ``P``).

During backward, a ready bucket is only noted (:meth:`PeerMean.start` does nothing collective, so that a rank
whose backward skips a bucket never holds up the others). When the reducer finishes the pass, every started bucket
is averaged in bucket order; the host queues the kernels and returns, and the optimizer step's kernels queue behind
them on the same stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpistrategy.aggregation.base import Aggregator, GradBucket, Work
from mpistrategy.aggregation.mean import MeanAggregator
from mpistrategy.comm.cuda_ipc import PeerDeviceGroup, share_one_gpu
from mpistrategy.comm.topology import Topology


class _Noted:
    """A bucket noted during backward: its average is queued when the pass finishes."""

    __slots__ = ()

    def test(self) -> bool:
        return False

    def wait(self) -> None:
        return None


_NOTED = _Noted()


class PeerMean(Aggregator):
    """``inner`` (the mean) over a :class:`~mpistrategy.comm.cuda_ipc.PeerDeviceGroup` of the buckets."""

    def __init__(self, inner: Aggregator, group: PeerDeviceGroup) -> None:
        self.inner = inner
        self.context = inner.context
        self.group = group

    def start(self, bucket: GradBucket) -> Work:
        if self.context is not None:
            self.context.sent(bucket.nbytes)
        return _NOTED

    def finish(self, bucket: GradBucket, work: Work) -> None:
        with torch.no_grad():
            self.group.sum(bucket.index, average=True)

    def __repr__(self) -> str:
        return f"PeerMean({self.inner!r}, ranks={self.group.size})"


class PeerSums:
    """The group over a layout's buckets, and the mean aggregator it replaces."""

    def __init__(self, topology: Topology, buckets: Sequence[GradBucket]) -> None:
        self.group = PeerDeviceGroup(topology.node_comm, [bucket.buffer for bucket in buckets])
        self._wrapped: PeerMean | None = None

    @staticmethod
    def applies(topology: Topology, aggregator: Aggregator, devices: set[torch.device]) -> bool:
        """Whether the mean ``aggregator`` over every rank can run on the device the ranks share (collective over
        the node; every rank of the world decides alike): more than one rank, all on this node, on one GPU, every
        bucket on it."""
        if topology.size == 1 or topology.local_size != topology.size:
            return False
        device = next(iter(devices)) if len(devices) == 1 else None
        mean = type(aggregator) is MeanAggregator
        return share_one_gpu(topology.node_comm, device if mean else None)

    def around(self, aggregator: Aggregator | None) -> Aggregator | None:
        """The mean as :class:`PeerMean`; ``None`` (a pass without communication) as it is."""
        if aggregator is None:
            return None
        if self._wrapped is None or self._wrapped.inner is not aggregator:
            self._wrapped = PeerMean(aggregator, self.group)
        self._wrapped.context = aggregator.context
        return self._wrapped

    def close(self) -> None:
        """Release the peers' buffers (collective over the node)."""
        self.group.close()
