"""Configurations a sync mode cannot run fail at setup on every rank, with the problem and the fix named."""

from __future__ import annotations

import pytest
import torch

from mpistrategy.aggregation import TopK
from mpistrategy.comm.topology import topology
from mpistrategy.strategy.failures import raised_on_every_rank
from mpistrategy.strategy.mpi_ad import MPIADStrategy
from mpistrategy.sync import DASO, LocalSGD, SyncConfigurationError, build_sync
from mpistrategy.sync.flat import FlatSync
from tests.strategy.helpers import RANK, SIZE, Regressor, loader, mlp, regression_data, trainer


def _fit(strategy: MPIADStrategy, steps: int = 2) -> None:
    data = regression_data(SIZE * 4 * steps)
    trainer(strategy=strategy, max_steps=steps).fit(Regressor(mlp()), loader(data, 4))


def test_unknown_mode_lists_the_valid_ones() -> None:
    with pytest.raises(SyncConfigurationError, match="valid modes: flat, hierarchical, local_sgd"):
        build_sync("dasso")
    with pytest.raises(SyncConfigurationError, match="period=0"):
        LocalSGD(period=0)
    with pytest.raises(SyncConfigurationError, match="unexpected keyword"):
        build_sync("local_sgd", periode=3)
    with pytest.raises(ValueError, match="node_transport='tcp'"):
        MPIADStrategy(node_transport="tcp")


@pytest.mark.mpi(ranks=(3,), timeout=120)
def test_daso_refuses_uneven_nodes_on_every_rank() -> None:
    """3 ranks as nodes of 2: node sizes (2, 1); every rank raises the same error, nobody hangs."""
    with pytest.raises(SyncConfigurationError, match=r"nodes have \[2, 1\] ranks"):
        _fit(MPIADStrategy(sync=DASO(), ranks_per_node=2))


class _BrokenOnRankOne(FlatSync):
    """A mode whose setup fails on rank 1 only."""

    def setup(self, context) -> None:
        super().setup(context)
        if context.topology.rank == 1:
            raise SyncConfigurationError("rank 1 cannot run this mode")


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
def test_setup_failing_on_one_rank_fails_on_every_rank() -> None:
    expected = "rank 1 cannot run this mode" if RANK == 1 else r"failed on rank\(s\) \[1\]"
    with pytest.raises(SyncConfigurationError, match=expected):
        _fit(MPIADStrategy(sync=_BrokenOnRankOne()))
    # the ranks are still in step: a collective afterwards pairs correctly
    assert topology().control.allreduce(RANK) == SIZE * (SIZE - 1) // 2


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
def test_ranks_given_different_sync_options_fail_together_before_any_setup() -> None:
    """Rank 0 averages every 4 steps, the others every 5: every rank raises, naming each rank's options, before a
    mode is set up (two modes would otherwise pair their collectives wrongly and wait forever)."""
    with pytest.raises(SyncConfigurationError, match="different sync mode options") as raised:
        _fit(MPIADStrategy(sync=LocalSGD(period=4 if RANK == 0 else 5)))
    others = "rank 1" if SIZE == 2 else f"ranks 1-{SIZE - 1}"  # ranks with one value are listed together
    assert "rank 0: local_sgd {'period': 4, 'warmup_steps': 0}" in str(raised.value)
    assert f"{others}: local_sgd {{'period': 5, 'warmup_steps': 0}}" in str(raised.value)
    with pytest.raises(SyncConfigurationError, match=f"rank 0: daso .*; {others}: local_sgd"):
        _fit(MPIADStrategy(sync="daso" if RANK == 0 else "local_sgd"))
    assert topology().control.allreduce(RANK) == SIZE * (SIZE - 1) // 2


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
def test_ranks_given_different_optimizers_fail_together_naming_each_ranks_hyperparameters() -> None:
    """The last rank's SGD has another learning rate, then momentum: replicas stepped differently would drift apart
    without a word, so every rank raises at setup with each rank's optimizer."""
    last = RANK == SIZE - 1
    with pytest.raises(SyncConfigurationError, match="different optimizer options") as raised:
        trainer(max_steps=2).fit(Regressor(mlp(), lr=0.5 if last else 0.1), loader(regression_data(SIZE * 8), 4))
    others = "rank 0" if SIZE == 2 else f"ranks 0-{SIZE - 2}"  # ranks with one value are listed together
    assert f"{others}: SGD(6 params, " in str(raised.value) and "lr=0.1," in str(raised.value)
    assert f"rank {SIZE - 1}: SGD(6 params, " in str(raised.value) and "lr=0.5," in str(raised.value)
    with pytest.raises(SyncConfigurationError, match=f"rank {SIZE - 1}: SGD.*momentum=0.9"):
        trainer(max_steps=2).fit(Regressor(mlp(), momentum=0.9 if last else 0.0), loader(regression_data(SIZE * 8), 4))
    assert topology().control.allreduce(RANK) == SIZE * (SIZE - 1) // 2


class _TwoOptimizers(Regressor):
    def configure_optimizers(self):
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[2].parameters(), lr=0.1)]


@pytest.mark.mpi(ranks=(2,), timeout=120)
@pytest.mark.parametrize("mode", ["local_sgd", "daso", "gossip"])
def test_modes_that_average_models_refuse_several_optimizers(mode: str) -> None:
    data = regression_data(SIZE * 8)
    model = _TwoOptimizers(mlp())
    model.automatic_optimization = False
    strategy = MPIADStrategy(sync=mode, ranks_per_node=1)
    with pytest.raises(SyncConfigurationError, match=f"{mode}: averages the model after each optimizer step"):
        trainer(strategy=strategy, max_steps=2).fit(model, loader(data, 4))


def test_an_aggregator_by_name_is_built_with_its_defaults_and_anything_else_is_refused() -> None:
    assert isinstance(MPIADStrategy(aggregator="topk").aggregator, TopK)
    with pytest.raises(ValueError, match="unknown aggregation scheme 'top_k'; valid names: mean, fp16"):
        MPIADStrategy(aggregator="top_k")
    with pytest.raises(TypeError, match="aggregator=3 is neither an Aggregator nor the name of one"):
        MPIADStrategy(aggregator=3)


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
def test_aggregator_options_that_differ_end_every_rank_together_without_an_abort() -> None:
    """The aggregator refuses options that differ between its ranks while the buckets are built; every rank
    raises, marked so, so that the job exits with each rank's traceback instead of an abort."""
    with pytest.raises(ValueError, match="topk: the ranks were given different options") as raised:
        _fit(MPIADStrategy(aggregator=TopK(density=0.1 if RANK == 0 else 0.2)))
    assert raised_on_every_rank(raised.value)
    assert topology().control.allreduce(RANK) == SIZE * (SIZE - 1) // 2
