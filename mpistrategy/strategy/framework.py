"""The Lightning package a strategy class belongs to: ``lightning.pytorch`` or the standalone ``pytorch_lightning``.

The two packages are separate copies with distinct classes, and Lightning checks types with ``isinstance`` (a
``lightning.pytorch`` callback is ignored by a ``pytorch_lightning`` Trainer). The strategy's logic is written
once; the few framework classes it needs (layer-sync plugin, exceptions, trainer states, ...) are looked up here by
package name, and the helper classes built on them are created once per package.
"""

from __future__ import annotations

import functools
import importlib
from types import SimpleNamespace

from torch import nn

from mpistrategy.nn.sync_batchnorm import SyncBatchNorm

LIGHTNING = "lightning.pytorch"
PYTORCH_LIGHTNING = "pytorch_lightning"


@functools.cache
def framework(name: str) -> SimpleNamespace:
    """Classes of the Lightning package ``name`` used by the strategy, plus helpers built on them."""
    fabric = "lightning.fabric" if name == LIGHTNING else "lightning_fabric"
    layer_sync = importlib.import_module(f"{name}.plugins.layer_sync")
    states = importlib.import_module(f"{name}.trainer.states")
    exceptions = importlib.import_module(f"{name}.utilities.exceptions")
    accelerators = importlib.import_module(f"{name}.accelerators")
    optimizer_utils = importlib.import_module(f"{fabric}.utilities.optimizer")
    checkpoint_io = importlib.import_module(f"{name}.plugins.io")
    seed = importlib.import_module(f"{fabric}.utilities.seed")

    class MPISyncBatchNorm(layer_sync.LayerSync):  # type: ignore[name-defined]  # imported by name above
        """``Trainer(sync_batchnorm=True)`` for the mpi_ad strategy: :class:`mpistrategy.nn.SyncBatchNorm`."""

        def apply(self, model: nn.Module) -> nn.Module:
            return SyncBatchNorm.convert_sync_batchnorm(model)

        def revert(self, model: nn.Module) -> nn.Module:
            return SyncBatchNorm.revert_sync_batchnorm(model)

    return SimpleNamespace(
        name=name,
        TrainerFn=states.TrainerFn,
        SIGTERMException=exceptions.SIGTERMException,
        TorchSyncBatchNorm=layer_sync.TorchSyncBatchNorm,
        CUDAAccelerator=accelerators.CUDAAccelerator,
        AsyncCheckpointIO=checkpoint_io.AsyncCheckpointIO,
        optimizers_to_device=optimizer_utils._optimizers_to_device,
        reset_seed=seed.reset_seed,
        MPISyncBatchNorm=MPISyncBatchNorm,
    )
