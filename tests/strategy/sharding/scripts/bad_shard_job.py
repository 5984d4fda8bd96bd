"""Rank 1 alone asks for an unknown shard mode: ``mpiexec -n 3 python bad_shard_job.py``."""

from __future__ import annotations

from mpi4py import MPI

from mpistrategy.strategy.mpi_ad import MPIADStrategy
from tests.strategy.helpers import Regressor, loader, mlp, regression_data, trainer

shard = "bogus" if MPI.COMM_WORLD.Get_rank() == 1 else "optimizer"
strategy = MPIADStrategy(shard=shard)
trainer(strategy=strategy, max_steps=2).fit(Regressor(mlp()), loader(regression_data(24), 4))
