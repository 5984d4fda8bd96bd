"""Configurations a sync mode cannot run fail at setup on every rank, with the problem and the fix named."""

from __future__ import annotations

import pytest

from mpistrategy.comm.topology import topology
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
