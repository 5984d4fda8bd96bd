"""Checkpoints: written atomically by rank 0, loaded on every rank, resuming continues the same trajectory."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from mpistrategy.aggregation import GradBucket, MeanAggregator
from mpistrategy.strategy.mpi_ad import CHECKPOINT_KEY, MPIADStrategy
from tests.strategy.helpers import (
    COMM,
    RANK,
    SIZE,
    Regressor,
    assert_same_on_all_ranks,
    flat_parameters,
    loader,
    mlp,
    regression_data,
    shared_tmpdir,
    trainer,
)


class CountingMean(MeanAggregator):
    """The mean, plus a counter that must survive checkpoints (a stand-in for real aggregator state)."""

    def __init__(self) -> None:
        self.combined = 0

    def start(self, bucket: GradBucket) -> Any:
        self.combined += 1
        return super().start(bucket)

    def state_dict(self) -> dict[str, Any]:
        return {"combined": self.combined}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.combined = state["combined"]


def _fit(directory: str, epochs: int, seed: int, ckpt_path: str | None = None) -> tuple[Regressor, CountingMean]:
    data = regression_data(SIZE * 4 * 3)
    model = Regressor(mlp(seed=seed), lr=0.1, momentum=0.9)
    aggregator = CountingMean()
    checkpoints = ModelCheckpoint(dirpath=directory, save_top_k=-1, filename="{epoch}")
    fit = trainer(
        strategy=MPIADStrategy(aggregator=aggregator),
        max_epochs=epochs,
        callbacks=[checkpoints],
        enable_checkpointing=True,
    )
    fit.fit(model, loader(data, 4), ckpt_path=ckpt_path)
    return model, aggregator


@pytest.mark.mpi(ranks=(2, 3), timeout=90)
def test_resume_continues_the_same_trajectory() -> None:
    directory = shared_tmpdir()
    straight, straight_aggregator = _fit(directory, epochs=3, seed=1)
    first = os.path.join(directory, "epoch=0.ckpt")
    assert os.path.exists(first)
    assert not [name for name in os.listdir(directory) if ".tmp" in name], "temporary files were left behind"
    saved = torch.load(first, weights_only=False)
    assert saved[CHECKPOINT_KEY] == {
        "aggregator": {"combined": straight_aggregator.combined // 3},
        "sync": {"name": "flat", "state": {}},
    }

    resumed, resumed_aggregator = _fit(shared_tmpdir(), epochs=3, seed=99, ckpt_path=first)  # other init
    assert_same_on_all_ranks(flat_parameters(resumed), "resumed parameters")
    torch.testing.assert_close(flat_parameters(resumed), flat_parameters(straight), rtol=0, atol=0)
    assert resumed_aggregator.combined == straight_aggregator.combined


@pytest.mark.mpi(ranks=(2,), timeout=60)
def test_checkpoint_only_rank_zero_can_see_is_broadcast() -> None:
    directory = shared_tmpdir()
    _fit(directory, epochs=1, seed=3)
    path = os.path.join(directory, "epoch=0.ckpt")
    mine = path if RANK == 0 else os.path.join(directory, f"missing-on-rank-{RANK}.ckpt")
    strategy = trainer().strategy
    checkpoint = strategy.load_checkpoint(mine)
    reference = COMM.bcast(torch.load(path, weights_only=False)["state_dict"] if RANK == 0 else None, root=0)
    for key, value in reference.items():
        torch.testing.assert_close(checkpoint["state_dict"][key], value)
