"""Sync modes that must reproduce flat data parallelism, to rounding (float64, plain SGD, 20 steps).

Run at 4 ranks as 2 virtual nodes of 2 and at 6 ranks as 3 nodes of 2 (``ranks_per_node=2``); at 3 ranks the
nodes are uneven (2 + 1), which the hierarchical mean must also average exactly.
"""

from __future__ import annotations

import logging

import pytest
import torch

from mpistrategy.aggregation import MeanAggregator, TopK
from mpistrategy.strategy.mpi_ad import MPIADStrategy
from mpistrategy.sync import DASO, FlatSync, HierarchicalLocalSGD, HierarchicalSync, LocalSGD
from tests.strategy.helpers import (
    RANK,
    SIZE,
    Regressor,
    assert_same_on_all_ranks,
    flat_parameters,
    loader,
    mlp,
    regression_data,
    trainer,
)

PER_RANK_BATCH = 4
STEPS = 20

MODES = {
    "hierarchical": lambda: HierarchicalSync(),
    "local_sgd-H1": lambda: LocalSGD(period=1),
    "hierarchical_local_sgd-H1": lambda: HierarchicalLocalSGD(period=1),
    "daso-skip1-wait0": lambda: DASO(
        warmup_epochs=0, cooldown_epochs=0, global_skip=1, batches_to_wait=0, downcast=None
    ),
}


def _train(sync, node_transport: str = "mpi", aggregator=None, ranks_per_node: int = 2, **fit_options) -> torch.Tensor:
    accumulate = fit_options.get("accumulate_grad_batches", 1)
    data = regression_data(SIZE * PER_RANK_BATCH * STEPS * accumulate)
    model = Regressor(mlp(seed=3), lr=0.1)
    strategy = MPIADStrategy(
        sync=sync,
        aggregator=aggregator or MeanAggregator(),
        ranks_per_node=ranks_per_node,
        node_transport=node_transport,
    )
    trainer(strategy=strategy, max_steps=STEPS, **fit_options).fit(model, loader(data, PER_RANK_BATCH))
    return flat_parameters(model)


@pytest.mark.mpi(ranks=(3, 4, 6), timeout=180)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_mode_equals_flat_averaging(mode: str) -> None:
    if mode.startswith("daso") and SIZE % 2:
        pytest.skip("DASO needs nodes of equal size; 3 ranks as nodes of 2 are uneven")
    want = _train(FlatSync())
    got = _train(MODES[mode]())
    assert not torch.equal(want, flat_parameters(mlp(seed=3))), "flat training did not move the parameters"
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert_same_on_all_ranks(got, "parameters")


class _TorchOptimizerSteps(Regressor):
    """Manual optimization whose steps are made on the torch optimizer itself, past the strategy
    (``self.optimizers(use_pl_optimizer=False)``)."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__(net, lr=0.1)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx: int) -> None:
        optimizer = self.optimizers(use_pl_optimizer=False)
        optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()


@pytest.mark.mpi(ranks=(2, 3), timeout=180)
@pytest.mark.parametrize("mode", ["local_sgd-H1", "hierarchical_local_sgd-H1"])
def test_steps_of_the_torch_optimizer_itself_average_the_replicas(mode: str) -> None:
    """Model averaging after every step (period 1) equals flat averaging also when the steps bypass Lightning's
    optimizer wrapper: the sync mode's work follows each step of the optimizer."""
    want = _train(FlatSync())
    data = regression_data(SIZE * PER_RANK_BATCH * STEPS)
    model = _TorchOptimizerSteps(mlp(seed=3))
    strategy = MPIADStrategy(sync=MODES[mode](), ranks_per_node=2)
    trainer(strategy=strategy, max_epochs=1).fit(model, loader(data, PER_RANK_BATCH))
    got = flat_parameters(model)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert_same_on_all_ranks(got, "parameters")


@pytest.mark.mpi(ranks=(3, 4), timeout=180)
@pytest.mark.parametrize("mode", ["hierarchical", "hierarchical_local_sgd-H1"])
def test_gloo_node_transport_equals_the_mpi_one(mode: str) -> None:
    """The node-local torch.distributed group (gloo, rendezvous over MPI) gives the MPI path's result."""
    want = _train(MODES[mode]())
    got = _train(MODES[mode](), node_transport="gloo")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.mpi(ranks=(3, 4), timeout=180)
def test_hierarchical_with_accumulation_and_clipping_equals_flat() -> None:
    options = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
    want = _train(FlatSync(), **options)
    got = _train(HierarchicalSync(), **options)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.mpi(ranks=(3, 4, 6), timeout=180)
def test_a_compressor_on_the_leaders_step_that_drops_nothing_equals_flat() -> None:
    """The user's aggregator combines only the node leaders' step; top-k at density 1 sends every value, so the
    hierarchy with it must still average exactly."""
    want = _train(FlatSync())
    got = _train(HierarchicalSync(), aggregator=TopK(density=1.0))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert_same_on_all_ranks(got, "parameters")


@pytest.mark.mpi(ranks=(2, 3), timeout=180)
@pytest.mark.parametrize(
    "mode", [lambda: HierarchicalSync(), lambda: HierarchicalLocalSGD(period=1, warmup_steps=STEPS)], ids=["h", "hl"]
)
def test_on_one_node_the_hierarchy_compresses_nothing_and_names_the_aggregator_unused(mode, caplog) -> None:
    """All ranks on one node: no step crosses nodes, so the leaders' step is the exact mean (a compressor there would
    lose 99% of the gradient and save no byte) and rank 0 warns that the aggregator is unused."""
    want = _train(FlatSync(), ranks_per_node=SIZE)
    with caplog.at_level(logging.WARNING):
        got = _train(mode(), aggregator=TopK(density=0.01), ranks_per_node=SIZE)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    unused = "the aggregator TopK(density=0.01, error_feedback=True) is not used" in caplog.text
    assert unused == (RANK == 0) and ("this run has 1 node(s)" in caplog.text) == (RANK == 0)
