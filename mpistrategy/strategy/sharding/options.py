"""The ``shard`` option of the ``mpi_ad`` strategy: its values, and the configurations it can run with.

- ``None`` (default): every rank keeps the whole optimizer state (flat data parallelism).
- ``"optimizer"`` (ZeRO stage 1): gradients are averaged as without sharding; each rank keeps the optimizer state
  of its shard of the parameters, steps only that shard, and the updated shards are allgathered.
- ``"gradients"`` (ZeRO stage 2): also the gradients are sharded: gradient buckets are reduce-scattered during
  backward, and each rank keeps only the averaged gradients of its shard.

Both run under the ``flat`` and ``hierarchical`` sync modes (under ``hierarchical`` the ranks of each node split
one copy of the state; see :mod:`~mpistrategy.strategy.sharding.group`). The modes whose replicas differ between
steps (local SGD, DASO, gossip) have no single copy of the state to split.
"""

from __future__ import annotations

from typing import Any

from mpistrategy.aggregation.mean import MeanAggregator

SHARD_MODES = ("optimizer", "gradients")
SHARDED_SYNC_MODES = ("flat", "hierarchical")


def check_shard(shard: Any, data_parallel: bool = True) -> str | None:
    """``shard`` if it is ``None`` or one of :data:`SHARD_MODES` and data parallelism is on; else raise
    ``ValueError`` naming the valid values."""
    if shard is None:
        return None
    if not isinstance(shard, str) or shard not in SHARD_MODES:
        valid = ", ".join(repr(mode) for mode in SHARD_MODES)
        raise ValueError(
            f"shard={shard!r} is not a shard mode; use {valid} (ZeRO stages 1 and 2), or None to keep the whole "
            "optimizer state on every rank."
        )
    if not data_parallel:
        raise ValueError(
            f"shard={shard!r} splits the optimizer state of replicated parameters, but data_parallel=False keeps "
            "no replicas; drop shard or use data_parallel=True."
        )
    return shard


def configuration_problem(
    shard: str | None, sync_name: str, aggregator: Any, node_sizes: tuple[int, ...]
) -> str | None:
    """Why ``shard`` cannot run with this sync mode, aggregator and nodes of ``node_sizes`` ranks (``None``: it
    can)."""
    if shard is None:
        return None
    if sync_name not in SHARDED_SYNC_MODES:
        valid = " or ".join(repr(name) for name in SHARDED_SYNC_MODES)
        return (
            f"shard={shard!r} needs every rank to apply the same averaged gradients each step (sync {valid}); sync "
            f"mode {sync_name!r} keeps replicas that differ between steps. Use sync='flat' or 'hierarchical' with "
            "shard, or drop shard."
        )
    if shard == "gradients" and type(aggregator) is not MeanAggregator:
        return (
            f"shard='gradients' reduce-scatters gradient buckets, which averages them, but the aggregator is "
            f"{aggregator!r}; use the default MeanAggregator with it, or shard='optimizer' (which keeps the "
            "aggregator)."
        )
    if shard == "gradients" and sync_name == "hierarchical" and len(set(node_sizes)) > 1:
        return (
            f"shard='gradients' under hierarchical sync averages each shard's gradients across nodes between the "
            f"ranks that hold it, so every node must have as many ranks; the nodes have {list(node_sizes)} ranks. "
            "Use nodes of equal size (ranks_per_node dividing the ranks of each node), sync='flat', or "
            "shard='optimizer'."
        )
    return None
