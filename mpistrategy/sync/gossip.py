"""Gossip (decentralised SGD, D-PSGD): every rank averages its model with its neighbours on a graph.

No gradient is averaged. After optimizer step ``t`` rank ``i`` applies

    x_i <- x_i + sum_{j in N(i)} w_ij (x_j^s - x_i^s)

where ``x^s`` are the states every rank sent after the previous mixing (their values at the start of step
``t``): with ``w_ii = 1 - sum_j w_ij`` this is Lian et al.'s ``x_{t+1} = W x_t - lr g_t``, and the exchange
(non-blocking point-to-point sends and receives with each neighbour) overlaps step ``t``'s forward and backward.
``period`` mixes every ``period``-th step only.

Graphs (undirected, ``P`` ranks): ``ring`` (``i +- 1``), ``torus`` (a 2-D ``rows x cols`` torus with ``rows`` the
largest divisor of ``P`` not above ``sqrt(P)``; a ring when ``P`` is prime), ``exponential`` (``i +- 2^k`` for
``2^k < P``), ``complete``, or a neighbour list (``neighbours[i]`` is rank ``i``'s list; it must be symmetric
and name existing ranks other than ``i``). Weights ``W`` are Metropolis-Hastings weights,
``w_ij = 1 / (1 + max(d_i, d_j))``, which make ``W`` symmetric and doubly stochastic for any undirected graph:
the mean of the states over all ranks is preserved by every mixing, and on the complete graph one mixing gives
every rank the exact mean (``w_ij = 1/P``).

The model state is the trainable parameters plus the floating-point buffers. A checkpoint holds every rank's
sent state and received neighbour states (gathered to rank 0), so that a resumed run applies the same mixing.
Resumed on fewer ranks, the graph is another one: the exchange in flight is dropped (rank 0 warns) and the next
mixing is that of the next exchange; on more ranks resuming is refused (the new ranks have no replica).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from mpi4py import MPI

from mpistrategy.aggregation.base import GradBucket
from mpistrategy.comm.buffers import mpi_buffer
from mpistrategy.comm.checks import is_integer
from mpistrategy.comm.communicator import Communicator
from mpistrategy.comm.traffic import INTER_NODE, NODE
from mpistrategy.sync.averaging import ModelAverager
from mpistrategy.sync.base import SyncConfigurationError, SyncContext, SyncMode
from mpistrategy.sync.local_sgd import check_positive

log = logging.getLogger(__name__)

GRAPHS = ("ring", "torus", "exponential", "complete")


def neighbours_of(graph: str | Sequence[Sequence[int]], size: int) -> list[list[int]]:
    """Every rank's sorted neighbour list for ``graph`` (a name of :data:`GRAPHS` or a neighbour list)."""
    if isinstance(graph, str):
        _check_graph_name(graph)
        return [sorted(_named_neighbours(graph, rank, size) - {rank}) for rank in range(size)]
    lists = [list(n) for n in graph]
    if len(lists) != size:
        raise SyncConfigurationError(
            f"gossip: the neighbour list has {len(lists)} entries but there are {size} ranks; give one list per rank."
        )
    for rank, row in enumerate(lists):
        for peer in row:
            if not is_integer(peer) or not 0 <= peer < size:
                raise SyncConfigurationError(
                    f"gossip: rank {rank}'s neighbour {peer!r} is not a rank (there are {size} ranks: 0..{size - 1})."
                )
            if peer == rank:
                raise SyncConfigurationError(f"gossip: rank {rank} lists itself as a neighbour; remove it.")
            if rank not in lists[peer]:
                raise SyncConfigurationError(
                    f"gossip: the neighbour list is not symmetric: rank {rank} lists {peer} but rank {peer} does "
                    f"not list {rank}; gossip needs an undirected graph."
                )
    return [sorted(set(row)) for row in lists]


def _check_graph_name(graph: str) -> None:
    if graph not in GRAPHS:
        raise SyncConfigurationError(
            f"gossip: graph={graph!r} is not one of {', '.join(map(repr, GRAPHS))} (or a neighbour list)."
        )


def _named_neighbours(graph: str, rank: int, size: int) -> set[int]:
    if graph == "ring":
        return {(rank - 1) % size, (rank + 1) % size}
    if graph == "complete":
        return set(range(size))
    if graph == "exponential":
        hops = [2**k for k in range(max(1, math.ceil(math.log2(max(size, 2))))) if 2**k < size]
        return {(rank + h) % size for h in hops} | {(rank - h) % size for h in hops}
    rows = max(d for d in range(1, math.isqrt(size) + 1) if size % d == 0)
    cols = size // rows
    row, col = divmod(rank, cols)
    return {
        ((row - 1) % rows) * cols + col,
        ((row + 1) % rows) * cols + col,
        row * cols + (col - 1) % cols,
        row * cols + (col + 1) % cols,
    }


def metropolis_weights(neighbours: list[list[int]]) -> list[dict[int, float]]:
    """Metropolis-Hastings weights ``w_ij = 1 / (1 + max(d_i, d_j))`` for every rank's neighbours."""
    degree = [len(n) for n in neighbours]
    return [{j: 1.0 / (1 + max(degree[i], degree[j])) for j in row} for i, row in enumerate(neighbours)]


class Gossip(SyncMode):
    """Decentralised averaging with neighbours on a graph (see the module docstring).

    Args:
        graph: ``"ring"``, ``"torus"``, ``"exponential"``, ``"complete"`` or a neighbour list per rank.
        period: mix every ``period`` optimizer steps (>= 1).
    """

    name = "gossip"
    one_optimizer_fix = "use one optimizer (or sync='flat')"
    replicas = "rank"

    def __init__(self, graph: str | Sequence[Sequence[int]] = "ring", period: int = 1) -> None:
        if isinstance(graph, str):
            _check_graph_name(graph)  # a neighbour list is checked against the number of ranks at setup
        else:
            graph = [list(row) for row in graph]
        self.graph = graph
        self.period = check_positive(self.name, "period", period)
        self.step = 0
        self._sent: list[torch.Tensor] | None = None
        self._received: dict[int, list[torch.Tensor]] = {}
        self._requests: list[MPI.Request] = []

    def setup(self, context: SyncContext) -> None:
        super().setup(context)
        topology = context.topology
        self.neighbours = neighbours_of(self.graph, topology.size)[topology.rank]
        self.weights = metropolis_weights(neighbours_of(self.graph, topology.size))[topology.rank]
        self.comm = Communicator(topology.gradients.comm.Dup())
        node_of = topology.control.allgather(topology.node_rank)
        self._scope = {peer: NODE if node_of[peer] == topology.node_rank else INTER_NODE for peer in self.neighbours}
        self.averager = ModelAverager(context.module, topology, context.traffic, "world")

    def setup_buckets(self, buckets: list[GradBucket]) -> None:
        """No gradient is communicated."""

    def gradient_aggregator(self) -> None:
        return None

    def uses_aggregator(self) -> bool:
        return False

    def after_optimizer_step(self) -> None:
        if self._sent is not None:
            self._mix()
        self.step += 1
        if self.step % self.period == 0 and self.neighbours:
            self._start_exchange()

    def _start_exchange(self) -> None:
        self._sent = self.averager.pack()
        self._received = {peer: [torch.empty_like(flat) for flat in self._sent] for peer in self.neighbours}
        requests = []
        for peer in self.neighbours:
            for flat, incoming in zip(self._sent, self._received[peer], strict=True):
                requests.append(self.comm.forward.Irecv(mpi_buffer(incoming), source=peer))
                requests.append(self.comm.forward.Isend(mpi_buffer(flat), dest=peer))
                self.ctx.traffic.add(self._scope[peer], flat.nbytes)
        self._requests = requests

    def _mix(self) -> None:
        """``x <- x + sum_j w_ij (x_j^s - x_i^s)`` with the states exchanged since the last mixing."""
        MPI.Request.Waitall(self._requests)
        self._requests = []
        assert self._sent is not None
        delta = [torch.zeros_like(flat) for flat in self._sent]
        for peer, flats in self._received.items():
            for total, incoming, own in zip(delta, flats, self._sent, strict=True):
                total.add_(incoming - own, alpha=self.weights[peer])
        self.averager.merge(delta, own=1.0, other=1.0)
        self._sent, self._received = None, {}

    def finish(self) -> None:
        """Mix the exchange in flight, then free the communicators (collective; end of training)."""
        if self._sent is not None:
            self._mix()
        self.averager.close()
        self.comm.free()

    def state_dict(self) -> dict[str, Any]:
        """The step and every rank's exchange in flight (completed), gathered to rank 0 (collective)."""
        if self._requests:
            MPI.Request.Waitall(self._requests)
            self._requests = []
        mine = {"sent": self._sent, "received": self._received}
        control = self.ctx.topology.control
        everyone = control.gather(mine, root=0) if control.Get_size() > 1 else [mine]
        return {"step": self.step, "ranks": everyone}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        topology = self.ctx.topology
        ranks = state["ranks"]
        if ranks is None or len(ranks) < topology.size:
            saved = "an unknown number of" if ranks is None else len(ranks)
            raise SyncConfigurationError(
                f"gossip: the checkpoint holds the exchanges of {saved} ranks, but {topology.size} ranks resume; "
                "resume gossip on at most the number of ranks it was saved with."
            )
        self.step = int(state["step"])
        self._requests = []
        if len(ranks) == topology.size:
            mine = ranks[topology.rank]
            self._sent = mine["sent"]
            self._received = {int(peer): flats for peer, flats in mine["received"].items()}
            return
        self._sent, self._received = None, {}
        if topology.rank == 0 and any(saved["sent"] is not None for saved in ranks):
            log.warning(
                "gossip: the checkpoint holds the exchange in flight of %d ranks and %d ranks resume on another "
                "graph: that exchange is dropped, and the next mixing is that of the next exchange.",
                len(ranks),
                topology.size,
            )

    def __repr__(self) -> str:
        graph = self.graph if isinstance(self.graph, str) else "custom"
        return f"Gossip(graph={graph!r}, period={self.period})"
