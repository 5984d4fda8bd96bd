"""Hierarchical local SGD: node-local data parallelism every step, the model averaged across nodes every
``period`` steps.

Optimizer steps ``s = 0, 1, ...``: during ``warmup_steps`` gradients are averaged over all ranks through the node
hierarchy (as :class:`~mpistrategy.sync.hierarchical.HierarchicalSync`); afterwards gradients are averaged inside
each node only (shared memory, every step) and after step ``s`` with ``(s - warmup_steps + 1) % period == 0`` the
model state is replaced by its mean over all ranks: a sum inside each node, an allreduce among the node leaders
(one copy of the model per node crosses the network), a broadcast inside the node, ``/ P``. The ranks of a node
hold the same parameters throughout, so the mean weighs each node by its number of ranks (exactly flat averaging
when ``period=1`` with plain SGD).
"""

from __future__ import annotations

from mpistrategy.aggregation.base import Aggregator, GradBucket
from mpistrategy.sync.base import SyncContext
from mpistrategy.sync.levels import HierarchicalAggregator, NodeMeanAggregator, across_nodes
from mpistrategy.sync.local_sgd import LocalSGD
from mpistrategy.sync.transport import node_transport


class HierarchicalLocalSGD(LocalSGD):
    """Node-local gradient averaging every step, model averaging across nodes every ``period`` steps.

    Args:
        period: ``H``, the number of steps between two averages across nodes (>= 1).
        warmup_steps: steps of hierarchical gradient averaging over all ranks first (>= 0).
    """

    name = "hierarchical_local_sgd"
    replicas = "node"
    sums_in_node = True
    route = "nodes"

    def setup(self, context: SyncContext) -> None:
        super().setup(context)
        topology = context.topology
        self.transport = node_transport(topology, context.node_transport, context.device)
        self.node_mean = NodeMeanAggregator(self.transport)
        scale = topology.num_nodes / topology.size
        self.leaders = across_nodes(context.aggregator, topology.num_nodes)
        self.hierarchical = HierarchicalAggregator(self.transport, self.leaders, topology.is_leader, scale)

    def setup_buckets(self, buckets: list[GradBucket]) -> None:
        topology = self.ctx.topology
        self.node_mean.setup(self.aggregation_context(buckets, topology.node_gradients, spans_nodes=False))
        self.hierarchical.setup(self.aggregation_context(buckets, topology.node_gradients, False, topology.gradients))
        if topology.leader_gradients is not None:
            leaders = self.aggregation_context(buckets, topology.leader_gradients, topology.num_nodes > 1)
            self.leaders.setup(leaders)

    def gradient_aggregator(self) -> Aggregator:
        return self.hierarchical if self.step < self.warmup_steps else self.node_mean

    def uses_aggregator(self) -> bool:
        """Only the warm-up steps of a run with several nodes average gradients across nodes."""
        return super().uses_aggregator() and self.ctx.topology.num_nodes > 1
