"""One MPI job of the re-sharding test: ``save`` trains a sharded run and saves a checkpoint; ``load`` resumes it
(on another number of ranks) sharded and unsharded, and writes what the tests compare.

    mpiexec -n N python reshard_job.py save <shard> <directory>
    mpiexec -n N python reshard_job.py load <shard> <directory>

``<shard>``: ``optimizer``, ``gradients`` or ``none`` (unsharded).
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

import lightning.pytorch as L
import torch

from mpistrategy.strategy.mpi_ad import MPIADStrategy
from mpistrategy.strategy.sharding.checkpoint import consolidate, consolidated_state
from tests.strategy.helpers import RANK, loader, trainer
from tests.strategy.sharding.helpers import BATCH, BUCKET_CAP_MB, DeepNet, data, parameter_vector

SAVED_STEPS, MORE_STEPS = 6, 4


class StateAtStart(L.Callback):
    """The whole optimizer state (on rank 0) as training (re)starts: what the checkpoint restored."""

    state: dict[str, Any] | None = None

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        sharding = trainer.strategy._sharding
        optimizer = trainer.optimizers[0]
        if sharding is None:
            self.state = copy.deepcopy(optimizer.state_dict()) if RANK == 0 else None
        else:
            self.state = copy.deepcopy(consolidated_state(sharding.sharded(optimizer), sharding.group.comm))


def _fit(shard: str | None, steps: int, ckpt_path: str | None = None) -> tuple[DeepNet, L.Trainer, StateAtStart]:
    model, start = DeepNet(), StateAtStart()
    strategy = MPIADStrategy(shard=shard, bucket_cap_mb=BUCKET_CAP_MB)
    fit = trainer(strategy=strategy, max_steps=steps, gradient_clip_val=0.5, callbacks=[start])
    fit.fit(model, loader(data(SAVED_STEPS + MORE_STEPS, 1), BATCH), ckpt_path=ckpt_path)
    return model, fit, start


def main() -> None:
    mode, shard, directory = sys.argv[1], None if sys.argv[2] == "none" else sys.argv[2], sys.argv[3]
    path = os.path.join(directory, "saved.ckpt")
    if mode == "save":
        _, fit, _ = _fit(shard, SAVED_STEPS)
        fit.save_checkpoint(path)
        return
    sharded, _, restored = _fit(shard, SAVED_STEPS + MORE_STEPS, path)
    unsharded, _, restored_unsharded = _fit(None, SAVED_STEPS + MORE_STEPS, path)
    if RANK == 0:
        torch.save(
            {
                "restored": restored.state,
                "restored_unsharded": restored_unsharded.state,
                "consolidated": consolidate(path)["optimizer_states"][0],
                "sharded_params": parameter_vector(sharded),
                "unsharded_params": parameter_vector(unsharded),
            },
            os.path.join(directory, f"loaded-{shard}.pt"),
        )


if __name__ == "__main__":
    main()
