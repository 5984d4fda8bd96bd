"""DataModules: scikit-learn's digits (real data shipped with scikit-learn) and synthetic data for throughput.

Data parallelism: Lightning gives each rank a disjoint shard (DistributedSampler) when the strategy is distributed,
so ``batch_size`` is per rank. Model parallelism (tensor-parallel and pipeline recipes) needs every rank to see the
same batches: ``same_batches_on_all_ranks=true`` gives a seeded sampler that shuffles identically everywhere (the
experiments for those recipes also set ``trainer.use_distributed_sampler=false``).
"""

from __future__ import annotations

from collections.abc import Iterator

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset


class SeededShuffleSampler(Sampler[int]):
    """A shuffle that depends only on ``seed`` and the epoch: every rank draws the same order."""

    def __init__(self, length: int, seed: int = 0) -> None:
        self.length, self.seed, self.epoch = length, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.length, generator=generator).tolist())

    def __len__(self) -> int:
        return self.length


def load_digits_split(
    val_fraction: float = 0.2, split_seed: int = 0, standardize: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as float32 tensors: ``x_train, y_train, x_val, y_val``.

    A fixed stratified split; features standardised with the training split's mean and standard deviation
    (pixels that are constant in training are only centred).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = digits.data.astype(np.float64)
    y = digits.target.astype(np.int64)
    x_train, x_val, y_train, y_val = train_test_split(x, y, test_size=val_fraction, random_state=split_seed, stratify=y)
    if standardize:
        mean = x_train.mean(axis=0)
        std = x_train.std(axis=0)
        std[std < 1e-8] = 1.0
        x_train = (x_train - mean) / std
        x_val = (x_val - mean) / std
    else:
        x_train, x_val = x_train / 16.0, x_val / 16.0
    as_x = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
    as_y = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))  # noqa: E731
    return as_x(x_train), as_y(y_train), as_x(x_val), as_y(y_val)


class _TensorDataModule(L.LightningDataModule):
    def __init__(self, batch_size: int, num_workers: int, same_batches_on_all_ranks: bool, seed: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.same_batches_on_all_ranks = same_batches_on_all_ranks
        self.seed = seed
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup() first"
        if self.same_batches_on_all_ranks:
            sampler = SeededShuffleSampler(len(self.train_set), seed=self.seed)
            return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "call setup() first"
        return DataLoader(self.val_set, batch_size=max(self.batch_size, 256), num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class DigitsDataModule(_TensorDataModule):
    """scikit-learn's 8x8 digits: 1797 images, 10 classes, 64 features (the CNN reshapes them to 1x8x8)."""

    num_classes = 10
    in_features = 64

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.2,
        split_seed: int = 0,
        standardize: bool = True,
        num_workers: int = 0,
        same_batches_on_all_ranks: bool = False,
    ) -> None:
        super().__init__(batch_size, num_workers, same_batches_on_all_ranks, split_seed)
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.standardize = standardize

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            x_train, y_train, x_val, y_val = load_digits_split(self.val_fraction, self.split_seed, self.standardize)
            self.train_set = TensorDataset(x_train, y_train)
            self.val_set = TensorDataset(x_val, y_val)


class SyntheticDataModule(_TensorDataModule):
    """A Gaussian mixture: one random centre per class plus unit noise (learnable, any size, nothing on disk)."""

    def __init__(
        self,
        num_samples: int = 8192,
        num_val_samples: int = 1024,
        in_features: int = 512,
        num_classes: int = 16,
        batch_size: int = 128,
        seed: int = 0,
        num_workers: int = 0,
        same_batches_on_all_ranks: bool = False,
    ) -> None:
        super().__init__(batch_size, num_workers, same_batches_on_all_ranks, seed)
        self.num_samples, self.num_val_samples = num_samples, num_val_samples
        self.in_features, self.num_classes = in_features, num_classes

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        generator = torch.Generator().manual_seed(self.seed)
        # Centres about 3 noise standard deviations apart whatever the dimension.
        centres = torch.randn(self.num_classes, self.in_features, generator=generator) * (2.0 / self.in_features**0.5)
        total = self.num_samples + self.num_val_samples
        y = torch.randint(self.num_classes, (total,), generator=generator)
        x = centres[y] + torch.randn(total, self.in_features, generator=generator) / self.in_features**0.25
        self.train_set = TensorDataset(x[: self.num_samples], y[: self.num_samples])
        self.val_set = TensorDataset(x[self.num_samples :], y[self.num_samples :])
