"""LightningModules for the recipes: an MLP and a small CNN for digits, and the same MLP sized for throughput.

All share :class:`ClassifierModule`: cross-entropy, torchmetrics accuracy (``train/acc``, ``val/acc``), losses
logged per step and per epoch (``train/loss``, ``val/loss``), and an optimizer given as a partial
(``torch.optim.SGD`` with its settings, from the ``optimizer`` config group) that receives the parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


def default_optimizer() -> OptimizerFactory:
    return partial(torch.optim.SGD, lr=0.1, momentum=0.9)


class ClassifierModule(L.LightningModule):
    """A classifier around ``self.net`` (set by subclasses); logs loss and accuracy for training and validation."""

    net: nn.Module

    def __init__(
        self, num_classes: int, optimizer: OptimizerFactory | None = None, scheduler: SchedulerFactory | None = None
    ) -> None:
        super().__init__()
        self.optimizer_factory = optimizer if optimizer is not None else default_optimizer()
        self.scheduler_factory = scheduler
        self.num_classes = num_classes
        self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss_and_logits(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits, y), logits, y

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss, logits, y = self.loss_and_logits(batch)
        self.train_acc(logits.detach(), y)
        self.log("train/loss", loss.detach(), on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        loss, logits, y = self.loss_and_logits(batch)
        self.val_acc(logits, y)
        self.log("val/loss", loss, on_step=False, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)

    def test_step(self, batch, batch_idx: int) -> None:
        loss, logits, y = self.loss_and_logits(batch)
        self.val_acc(logits, y)
        self.log("test/loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("test/acc", self.val_acc, on_step=False, on_epoch=True)

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer), "interval": "epoch"},
        }


def mlp(in_features: int, hidden: int, depth: int, num_classes: int, dropout: float = 0.0) -> nn.Sequential:
    """``depth`` hidden layers of width ``hidden`` (Linear, ReLU, optional Dropout), then a linear head
    (``depth=0``: a linear classifier)."""
    if depth < 0:
        raise ValueError(f"model.depth must be at least 0, got {depth}")
    layers: list[nn.Module] = []
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


class MLPClassifier(ClassifierModule):
    """A fully connected classifier. Digits: ``in_features=64``; the throughput preset uses a wide, deep one."""

    def __init__(
        self,
        in_features: int = 64,
        hidden: int = 128,
        depth: int = 2,
        num_classes: int = 10,
        dropout: float = 0.0,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
    ) -> None:
        super().__init__(num_classes, optimizer, scheduler)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.net = mlp(in_features, hidden, depth, num_classes, dropout)


class CNNClassifier(ClassifierModule):
    """Two 3x3 convolutions and a max-pool on ``image_size`` x ``image_size`` single-channel images, then an MLP
    head. Inputs may come flat (``N x image_size**2``, as the digits DataModule gives them)."""

    def __init__(
        self,
        image_size: int = 8,
        channels: int = 32,
        hidden: int = 128,
        num_classes: int = 10,
        dropout: float = 0.0,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
    ) -> None:
        super().__init__(num_classes, optimizer, scheduler)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        if image_size % 2:
            raise ValueError(f"model.image_size must be even (a 2x2 max-pool follows), got {image_size}")
        self.image_size = image_size
        pooled = (image_size // 2) ** 2 * channels
        self.net = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Dropout(dropout) if dropout > 0 else nn.Identity(),
            nn.Linear(pooled, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.reshape(-1, 1, self.image_size, self.image_size))
