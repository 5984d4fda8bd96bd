"""``strategy=mpi_ad_model_parallel``: mpi_ad for models whose parameters are split across the ranks.

A tensor-parallel layer holds a different slice of a weight on each rank, and a pipeline stage holds different
layers: the two things mpi_ad does for data parallelism would be wrong for them - broadcasting rank 0's parameters
at setup (it would overwrite every other rank's slice) and averaging gradients across ranks (each rank's gradient
belongs to its own slice). :class:`ModelParallelMPIStrategy` is mpi_ad without those two steps; everything else is
mpi_ad's: ranks from MPI, rank-0 checkpoints, ``reduce``/``broadcast``/``barrier`` for logging, torchmetrics sync,
abort on exception, coordinated stop on SIGTERM/SIGUSR1 with a checkpoint.

The model-parallel recipes (:mod:`mpistrategy.recipes.tensor_parallel`, :mod:`mpistrategy.recipes.pipeline`) initialise
identically on every rank from a seeded dense twin and write checkpoints that hold the gathered dense weights, so they
need neither step. Use it with ``trainer.use_distributed_sampler=false`` and ``data.same_batches_on_all_ranks=true``
(the ``tp_mlp`` and ``pipeline_mlp`` experiments set both).
"""

from __future__ import annotations

from typing import Any

from mpistrategy.strategy.mpi_ad import MPIADStrategy


class ModelParallelMPIStrategy(MPIADStrategy):
    """mpi_ad with ``data_parallel=False``: no initial broadcast and no gradient averaging (see the module
    docstring)."""

    strategy_name = "mpi_ad_model_parallel"

    def setup(self, trainer: Any) -> None:
        self.data_parallel = False  # set here, so that the constructor keeps mpi_ad's signature for the configs
        super().setup(trainer)
