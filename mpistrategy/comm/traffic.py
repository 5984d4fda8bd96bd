"""Counting what a rank sends: payload bytes handed to MPI (or to a node-local transport), by where they travel.

The unit is the *payload* a rank contributes to an operation, in bytes, not what the algorithm puts on the wire:
an allreduce of an ``n``-byte buffer counts ``n`` (a ring algorithm moves ``2 (P-1)/P n`` per rank, a tree
``n`` per level; a cost model applies those factors on top), an allgather of ``k`` bytes per rank counts ``k``, a
send counts its message. An operation on a one-rank communicator of a larger job (a node of one rank, the node
leaders of a one-node job) counts nothing: no byte leaves the rank. Two scopes:

- ``node``: the operation's ranks all share one node (the node communicator, or the world on one node);
- ``inter_node``: the operation's ranks span several nodes (the world on several nodes, the node leaders, ranks of
  equal local rank across nodes, gossip neighbours on other nodes).

A :class:`TrafficCounter` accumulates both per optimizer step; the strategy logs and resets it after each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Scope = Literal["node", "inter_node"]
NODE: Scope = "node"
INTER_NODE: Scope = "inter_node"


@dataclass
class TrafficCounter:
    """Payload bytes sent by this rank since the last :meth:`take`, and in total, by scope."""

    node: int = 0
    inter_node: int = 0
    total_node: int = 0
    total_inter_node: int = 0

    def add(self, scope: Scope, nbytes: int) -> None:
        """Record ``nbytes`` sent by this rank in ``scope``."""
        if scope == NODE:
            self.node += int(nbytes)
            self.total_node += int(nbytes)
        elif scope == INTER_NODE:
            self.inter_node += int(nbytes)
            self.total_inter_node += int(nbytes)
        else:
            raise ValueError(f"traffic scope must be {NODE!r} or {INTER_NODE!r}, got {scope!r}.")

    def take(self) -> tuple[int, int]:
        """The ``(node, inter_node)`` bytes since the previous call, and start counting afresh."""
        taken = (self.node, self.inter_node)
        self.node = self.inter_node = 0
        return taken

    @property
    def total(self) -> int:
        """All bytes sent since the counter was created."""
        return self.total_node + self.total_inter_node


def scope_of(spans_nodes: bool) -> Scope:
    """The scope of an operation whose ranks span several nodes (``True``) or share one (``False``)."""
    return INTER_NODE if spans_nodes else NODE
