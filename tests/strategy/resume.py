"""A run that depends on every random generator, stopped by a signal in the middle of an epoch and resumed from
its checkpoint: the fixtures shared by the strategy's and the sync modes' resume tests."""

from __future__ import annotations

import os
import random
import signal
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import Strategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mpistrategy.aggregation import Aggregator
from mpistrategy.strategy.failures import STOPPED_EXIT_CODE
from mpistrategy.strategy.mpi_ad import MPIADStrategy
from mpistrategy.strategy.resumable import ResumableLoader
from tests.strategy.helpers import RANK, SIZE, Regressor, loader, mlp, regression_data, trainer

BATCH = 4


class NoisyDropoutModel(L.LightningModule):
    """Dropout (torch's generator) and a loss scale drawn from numpy's and python's generators, and a stateful
    optimizer (AdamW, or SGD with momentum): training depends on every random generator a resume must restore."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 2)).double()
        self.optimizer = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        scale = 1.0 + 0.1 * float(np.random.rand()) + 0.1 * random.random()
        return scale * nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)


class SignalAt(L.Callback):
    """Sends ``signum`` to this process on the last rank once ``step`` optimizer steps are done."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and RANK == SIZE - 1:
            os.kill(os.getpid(), self.signum)


def shuffled_loader(batches_per_epoch: int) -> DataLoader:
    """``batches_per_epoch`` batches per rank, shuffled each epoch by the distributed sampler."""
    samples = SIZE * BATCH * batches_per_epoch
    g = torch.Generator().manual_seed(5)
    x = torch.randn(samples, 6, generator=g, dtype=torch.float64)
    data = TensorDataset(x, torch.randn(samples, 2, generator=g, dtype=torch.float64))
    return DataLoader(data, batch_size=BATCH, shuffle=True)


def fit_noisy(
    directory: str,
    epochs: int,
    batches_per_epoch: int,
    strategy: Callable[[], Strategy | str] = lambda: "mpi_ad",
    optimizer: str = "adamw",
    accumulate: int = 1,
    callbacks: tuple = (),
    ckpt_path: str | None = None,
    validate: bool = False,
    **trainer_options: Any,
) -> tuple[L.LightningModule, L.Trainer, int | None]:
    """Fit the noisy model (each rank's generators seeded differently, so each has its own random stream) with a
    new ``strategy()`` (``validate``: on the first batches of the training data too); returns the model, the
    trainer and the exit code of a stop (``None`` if fit returned)."""
    L.seed_everything(100, verbose=False)  # also the seed of the distributed sampler: the same on every rank
    model = NoisyDropoutModel(optimizer)
    torch.manual_seed(200 + RANK)
    np.random.seed(300 + RANK)
    random.seed(400 + RANK)
    fit = trainer(
        strategy=strategy(),
        max_epochs=epochs,
        default_root_dir=directory,
        accumulate_grad_batches=accumulate,
        callbacks=list(callbacks),
        **trainer_options,
    )
    validation = DataLoader(shuffled_loader(batches_per_epoch).dataset, batch_size=BATCH) if validate else None
    try:
        fit.fit(model, shuffled_loader(batches_per_epoch), validation, ckpt_path=ckpt_path)
    except SystemExit as stop:
        return model, fit, stop.code
    return model, fit, None


def fit_with_epoch_checkpoints(
    aggregator: Aggregator, directory: str, epochs: int, seed: int, ckpt_path: str | None = None
) -> Regressor:
    """Fit a regressor (SGD with momentum) combining gradients with ``aggregator``, writing ``epoch=<n>.ckpt`` in
    ``directory`` after every epoch; resume from ``ckpt_path`` if given."""
    model = Regressor(mlp(seed=seed), lr=0.1, momentum=0.9)
    checkpoints = ModelCheckpoint(dirpath=directory, save_top_k=-1, filename="{epoch}")
    fit = trainer(
        strategy=MPIADStrategy(aggregator=aggregator),
        max_epochs=epochs,
        callbacks=[checkpoints],
        enable_checkpointing=True,
    )
    fit.fit(model, loader(regression_data(SIZE * 4 * 3), 4), ckpt_path=ckpt_path)
    return model


def stop_then_resume(
    directory: str, signum: int, signal_step: int, callbacks: tuple = (), **options: Any
) -> tuple[L.LightningModule, L.Trainer]:
    """Fit until ``signum`` arrives after ``signal_step`` steps (every rank stops one step later, exit code 75, a
    checkpoint of that step), then resume from that checkpoint to the end, both with ``callbacks`` too; returns the
    resumed model and trainer."""
    _, stopped, code = fit_noisy(directory, callbacks=(SignalAt(signal_step, signum), *callbacks), **options)
    assert code == STOPPED_EXIT_CODE
    assert stopped.global_step == signal_step + 1  # every rank decides one step after the signal
    checkpoint = os.path.join(directory, "hpc_ckpt_1.ckpt")
    assert torch.load(checkpoint, weights_only=True)["global_step"] == signal_step + 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, fit, code = fit_noisy(directory, ckpt_path=checkpoint, callbacks=callbacks, **options)
    assert code is None
    assert not [w for w in caught if "not resumable" in str(w.message)], "Lightning called the dataloader unresumable"
    assert isinstance(fit.train_dataloader, ResumableLoader) and isinstance(fit.train_dataloader, DataLoader)
    return model, fit


def assert_same_training_state(resumed: tuple, reference: tuple) -> None:
    """This rank's parameters and optimizer state are bit for bit those of the reference run."""
    (model, fit), (reference_model, reference_fit) = resumed, reference
    assert fit.global_step == reference_fit.global_step
    for name, value in reference_model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), f"parameter {name} differs from the uninterrupted run"
    state, reference_state = fit.optimizers[0].state_dict()["state"], reference_fit.optimizers[0].state_dict()["state"]
    assert state.keys() == reference_state.keys()
    for index, values in reference_state.items():
        for key, value in values.items():
            assert torch.equal(state[index][key], value), f"optimizer state {key} of parameter {index} differs"


SIGNALS = {"SIGUSR1": signal.SIGUSR1, "SIGTERM": signal.SIGTERM}
