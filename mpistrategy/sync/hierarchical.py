"""Hierarchical gradient averaging: every step, through the node hierarchy, with the result of flat averaging.

Per bucket (see :class:`~mpistrategy.sync.levels.HierarchicalAggregator`): a sum inside each node over the node
transport, the node leaders' combination across nodes by the user's aggregator (the mean over the ``N`` leaders of
``S_n N / P``, which is ``(1/P) sum_r g_r``), and a broadcast inside each node. Only one copy of each bucket per
node crosses the network, instead of one per rank; a compressing aggregator compresses only that inter-node step
(on one node there is none: the leader's step is the exact mean and the aggregator is unused).
"""

from __future__ import annotations

from mpistrategy.aggregation.base import Aggregator, GradBucket
from mpistrategy.sync.base import SyncContext, SyncMode
from mpistrategy.sync.levels import HierarchicalAggregator, across_nodes
from mpistrategy.sync.transport import node_transport


class HierarchicalSync(SyncMode):
    """Every step: node sum, inter-node combination among node leaders, node broadcast."""

    name = "hierarchical"
    sums_in_node = True

    def setup(self, context: SyncContext) -> None:
        super().setup(context)
        topology = context.topology
        self.transport = node_transport(topology, context.node_transport, context.device)
        scale = topology.num_nodes / topology.size
        self.leaders = across_nodes(context.aggregator, topology.num_nodes)
        self.aggregator = HierarchicalAggregator(self.transport, self.leaders, topology.is_leader, scale)

    def setup_buckets(self, buckets: list[GradBucket]) -> None:
        topology = self.ctx.topology
        self.aggregator.setup(self.aggregation_context(buckets, topology.node_gradients, False, topology.gradients))
        if topology.leader_gradients is not None:
            spans_nodes = topology.num_nodes > 1
            self.leaders.setup(self.aggregation_context(buckets, topology.leader_gradients, spans_nodes))

    def uses_aggregator(self) -> bool:
        """Not on one node (no step crosses nodes)."""
        return self.ctx.topology.num_nodes > 1

    def gradient_aggregator(self) -> Aggregator:
        return self.aggregator

    def __repr__(self) -> str:
        return f"HierarchicalSync(node_transport={self.ctx.node_transport!r})" if self.context else "HierarchicalSync()"
