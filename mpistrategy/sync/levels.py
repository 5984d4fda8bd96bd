"""Gradient aggregators for the levels of a node hierarchy: the node-local mean and the hierarchical mean.

- :class:`NodeMeanAggregator`: ``g <- (1/L) sum_{r in node} g_r`` over the node's ``L`` ranks, through a
  :class:`~mpistrategy.sync.transport.NodeTransport` (MPI shared memory or a torch.distributed group).
- :class:`HierarchicalAggregator`: the mean over all ``P`` ranks in three stages per bucket,

  1. node sum ``S_n = sum_{r in node n} g_r`` (node transport, every rank);
  2. on the node leaders only, ``S_n * N / P`` combined by an inner aggregator over the ``N`` leaders (the mean,
     or a compressing scheme): for the mean this gives ``(1/N) sum_n S_n N / P = (1/P) sum_r g_r``, exactly flat
     averaging also when nodes have different sizes;
  3. broadcast of the leader's result to its node (node transport).

  Only stage 2 crosses nodes: one bucket per node per step instead of one per rank. Stages advance in bucket
  order whenever MPI progress is driven (``test``), so stage 2 of early buckets overlaps the rest of backward;
  the node broadcasts are posted when the buckets are finished, after every bucket's node sum, so that every
  rank posts its node-level operations in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpistrategy.aggregation.base import Aggregator, GradBucket, Work
from mpistrategy.aggregation.mean import MeanAggregator
from mpistrategy.sync.transport import MPINodeTransport, NodeTransport


def across_nodes(aggregator: Aggregator, num_nodes: int) -> Aggregator:
    """The aggregator of the node leaders' step (stage 2): the user's ``aggregator``; on one node, where that step
    is one leader's and crosses no network, the exact mean (compressing it would lose precision and save nothing)."""
    return aggregator if num_nodes > 1 else MeanAggregator()


class NodeMeanAggregator(Aggregator):
    """Averages each bucket over the ranks of this node, in place, through ``transport``."""

    def __init__(self, transport: NodeTransport) -> None:
        self.transport = transport
        self.combines_on_host = isinstance(transport, MPINodeTransport)
        self.starts_on_streams = transport.on_streams

    def start(self, bucket: GradBucket) -> Work:
        assert self.context is not None, "NodeMeanAggregator.setup() was not called"
        self.context.sent(bucket.nbytes)
        return self.transport.start_sum(bucket.buffer)

    def finish(self, bucket: GradBucket, work: Work) -> None:
        work.wait()
        if self.transport.size > 1:
            with torch.no_grad():
                bucket.buffer.mul_(1.0 / self.transport.size)

    def __repr__(self) -> str:
        return f"NodeMeanAggregator(transport={type(self.transport).__name__})"


@dataclass
class _Flight:
    """One bucket on its way through the three stages."""

    bucket: GradBucket
    node_sum: Work
    inner: Work | None = None
    stage: int = 1  # 1: node sum in flight; 2: inner combine in flight (leaders); 3: ready for the broadcast


class HierarchicalAggregator(Aggregator):
    """The mean over all ranks through the node hierarchy (see the module docstring).

    Args:
        transport: the node-local transport (node sums and broadcasts).
        inner: the aggregator the node leaders combine with across nodes (set up by the sync mode over the
            leaders' communicator; unused on the other ranks).
        is_leader: whether this rank is its node's leader.
        scale: ``N / P``, applied by the leaders to the node sum before ``inner``.
    """

    def __init__(self, transport: NodeTransport, inner: Aggregator, is_leader: bool, scale: float) -> None:
        self.transport = transport
        self.inner = inner
        self.is_leader = is_leader
        self.scale = scale
        self.combines_on_host = isinstance(transport, MPINodeTransport) and inner.combines_on_host
        self.starts_on_streams = transport.on_streams
        self._flights: list[_Flight] = []

    def start(self, bucket: GradBucket) -> Work:
        assert self.context is not None, "HierarchicalAggregator.setup() was not called"
        self.context.sent(bucket.nbytes)
        flight = _Flight(bucket, self.transport.start_sum(bucket.buffer))
        self._flights.append(flight)
        return _FlightWork(self, flight)

    def _advance(self, blocking_until: _Flight | None = None) -> None:
        """Move buckets to their next stage, oldest first, stopping at the first that is not ready (so that
        every rank posts each communicator's operations in bucket order); block for ``blocking_until`` and the
        buckets before it."""
        for flight in self._flights:
            must = blocking_until is not None
            if flight.stage == 1:
                if not must and not flight.node_sum.test():
                    return
                flight.node_sum.wait()
                flight.stage = 2
                if self.is_leader:
                    with torch.no_grad():
                        flight.bucket.buffer.mul_(self.scale)
                    flight.inner = self.inner.start(flight.bucket)
            if flight.stage == 2:
                if flight.inner is not None:
                    if not must and not flight.inner.test():
                        return
                    self.inner.finish(flight.bucket, flight.inner)
                    flight.inner = None
                flight.stage = 3
            if flight is blocking_until:
                return

    def finish(self, bucket: GradBucket, work: Work) -> None:
        flight = work.flight  # type: ignore[attr-defined]
        self._advance(blocking_until=flight)
        self.transport.start_broadcast(bucket.buffer, 0).wait()
        self._flights.remove(flight)

    def setup(self, context) -> None:
        super().setup(context)
        self._flights = []

    def __repr__(self) -> str:
        return f"HierarchicalAggregator(transport={type(self.transport).__name__}, inner={self.inner!r})"


class _FlightWork:
    """The :class:`~mpistrategy.aggregation.Work` of one bucket in a :class:`HierarchicalAggregator`."""

    __slots__ = ("owner", "flight")

    def __init__(self, owner: HierarchicalAggregator, flight: _Flight) -> None:
        self.owner, self.flight = owner, flight

    def test(self) -> bool:
        self.owner._advance()
        return self.flight.stage == 3

    def wait(self) -> None:
        self.owner._advance(blocking_until=self.flight)
