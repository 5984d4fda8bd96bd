"""Gossip: graphs, Metropolis-Hastings weights, and the mixing on real ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpistrategy.aggregation import MeanAggregator
from mpistrategy.comm.topology import topology
from mpistrategy.sync import Gossip, SyncConfigurationError, SyncContext
from mpistrategy.sync.gossip import metropolis_weights, neighbours_of
from tests.strategy.helpers import COMM, RANK, SIZE


@pytest.mark.parametrize("graph", ["ring", "torus", "exponential", "complete"])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 6, 8, 9, 12])
def test_named_graphs_are_symmetric_and_weights_doubly_stochastic(graph: str, size: int) -> None:
    neighbours = neighbours_of(graph, size)
    for rank, row in enumerate(neighbours):
        assert rank not in row and all(rank in neighbours[peer] for peer in row)
    weights = metropolis_weights(neighbours)
    matrix = torch.zeros(size, size, dtype=torch.float64)
    for i, row in enumerate(weights):
        for j, w in row.items():
            matrix[i, j] = w
        matrix[i, i] = 1 - sum(row.values())
    torch.testing.assert_close(matrix, matrix.T)
    torch.testing.assert_close(matrix.sum(0), torch.ones(size, dtype=torch.float64))
    assert (matrix >= 0).all()


def test_graph_shapes() -> None:
    assert neighbours_of("ring", 5)[0] == [1, 4]
    assert neighbours_of("torus", 6)[0] == [1, 2, 3]  # 2 x 3 torus: up/down coincide
    assert neighbours_of("exponential", 8)[0] == [1, 2, 4, 6, 7]
    assert neighbours_of("complete", 4)[2] == [0, 1, 3]


@pytest.mark.parametrize(
    "graph, message",
    [
        ("star", "not one of"),
        ([[1], [2], [0]], "not symmetric"),
        ([[1], [0, 3]], "not a rank"),
        ([[0, 1], [0]], "lists itself"),
        ([[1], [0], [1]], "not symmetric"),
        ([[1]], "one list per rank"),
    ],
)
def test_bad_graphs_are_refused(graph, message: str) -> None:
    size = 3 if not isinstance(graph, list) or len(graph) != 2 else 2
    if graph == [[1]]:
        size = 2
    with pytest.raises(SyncConfigurationError, match=message):
        neighbours_of(graph, size)


def test_an_unknown_graph_name_is_refused_when_the_mode_is_built() -> None:
    with pytest.raises(SyncConfigurationError, match=r"graph='rnig' is not one of 'ring', 'torus'"):
        Gossip(graph="rnig")
    assert Gossip(graph=[[1], [0]]).graph == [[1], [0]]  # a neighbour list waits for the number of ranks


def _gossip(graph) -> tuple[Gossip, nn.Module]:
    module = nn.Linear(5, 3).double()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + RANK), dtype=torch.float64))
    gossip = Gossip(graph)
    gossip.setup(SyncContext(module, topology(), MeanAggregator()))
    return gossip, module


def _state(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


@pytest.mark.mpi(ranks=(2, 3, 4))
def test_complete_graph_mixes_to_the_exact_mean() -> None:
    gossip, module = _gossip("complete")
    mean = sum(COMM.allgather(_state(module))) / SIZE
    gossip.after_optimizer_step()  # sends the current state
    gossip.after_optimizer_step()  # mixes it (and sends the mixed state)
    torch.testing.assert_close(_state(module), mean, rtol=0, atol=1e-14)
    gossip.finish()  # completes the exchange in flight
    torch.testing.assert_close(_state(module), mean, rtol=0, atol=1e-14)


@pytest.mark.mpi(ranks=(2, 3, 4))
def test_ring_preserves_the_mean_and_contracts_the_spread() -> None:
    gossip, module = _gossip("ring")
    start = torch.stack(COMM.allgather(_state(module)))
    for _ in range(6):
        gossip.after_optimizer_step()
    gossip.finish()
    end = torch.stack(COMM.allgather(_state(module)))
    torch.testing.assert_close(end.mean(0), start.mean(0), rtol=0, atol=1e-14)
    if SIZE > 1:
        assert (end - end.mean(0)).norm() < 0.5 * (start - start.mean(0)).norm()


@pytest.mark.mpi(ranks=(2, 3))
def test_mixing_matches_the_matrix_with_a_custom_neighbour_list() -> None:
    neighbours = [[1], [0]] if SIZE == 2 else [[1, 2], [0], [0]]
    gossip, module = _gossip(neighbours)
    states = torch.stack(COMM.allgather(_state(module)))
    weights = metropolis_weights(neighbours_of(neighbours, SIZE))[RANK]
    want = states[RANK] + sum(w * (states[j] - states[RANK]) for j, w in weights.items())
    gossip.after_optimizer_step()
    gossip.after_optimizer_step()
    torch.testing.assert_close(_state(module), want, rtol=0, atol=1e-14)
    gossip.finish()
