"""The ``mpi_ad`` strategy and MPI environment for the standalone ``pytorch_lightning`` package.

``pytorch_lightning`` is a separate copy of Lightning with its own classes: its Trainer only accepts strategies
derived from *its* ``ParallelStrategy`` and environments derived from ``lightning_fabric``'s
``ClusterEnvironment`` (and its loops check ``isinstance`` against its own classes, e.g. before
``block_backward_sync``). One class cannot serve both packages, so these twins share the whole implementation
with :mod:`mpistrategy.strategy.mpi_ad` and only change the base classes.
"""

from __future__ import annotations

from lightning_fabric.plugins.environments import ClusterEnvironment
from pytorch_lightning.strategies import ParallelStrategy

from mpistrategy.strategy.environment import MPIEnvironmentMixin
from mpistrategy.strategy.framework import PYTORCH_LIGHTNING
from mpistrategy.strategy.mpi_ad import MPIADStrategyMixin


class MPIEnvironment(MPIEnvironmentMixin, ClusterEnvironment):
    """:class:`mpistrategy.strategy.environment.MPIEnvironment` for ``pytorch_lightning``."""


class MPIADStrategy(MPIADStrategyMixin, ParallelStrategy):
    """:class:`mpistrategy.strategy.mpi_ad.MPIADStrategy` for ``pytorch_lightning``."""

    _framework_name = PYTORCH_LIGHTNING
    _environment_class = MPIEnvironment
