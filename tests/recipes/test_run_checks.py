"""Checks ``mpistrategy-train`` makes before it trains, on every rank together (2-3 ranks): ranks that composed
different configs, and a strategy that would make every rank train alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from mpi4py import MPI

from mpistrategy.recipes.config import register_configs
from mpistrategy.recipes.train import CONFIG_DIR, train
from tests.strategy.helpers import shared_tmpdir

pytestmark = pytest.mark.mpi(ranks=(2, 3), timeout=120)


def _cfg(run_dir: Path, *overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(
            "config",
            overrides=[f"paths.output_dir={run_dir}", "trainer=debug", "summary.table=false", *overrides],
        )


def test_a_value_that_differs_on_one_rank_stops_every_rank_naming_it() -> None:
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    epochs = 3 if rank == size - 1 else 2
    listing = f"{'rank 0' if size == 2 else f'ranks 0-{size - 2}'}: 2; rank {size - 1}: 3"
    with pytest.raises(RuntimeError, match="the ranks composed different configs: .*trainer.max_epochs") as raised:
        train(_cfg(Path(shared_tmpdir()), f"trainer.max_epochs={epochs}"))
    assert f"trainer.max_epochs ({listing})" in str(raised.value)
    assert not (Path(shared_tmpdir()) / "checkpoints").exists()


def test_a_strategy_of_one_process_under_several_ranks_is_refused_on_every_rank() -> None:
    refused = r"strategy=auto makes a Trainer of 1 process\(es\) \(SingleDeviceStrategy\)"
    with pytest.raises(RuntimeError, match=refused):
        train(_cfg(Path(shared_tmpdir()), "strategy=auto"))
