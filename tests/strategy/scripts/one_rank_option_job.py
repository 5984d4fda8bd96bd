"""Rank 1 alone gives ``MPIADStrategy`` another value of one option, then every rank trains two steps:
``mpiexec -n 3 python one_rank_option_job.py NAME VALUE RANK1_VALUE`` (values as JSON, e.g. ``shard '"optimizer"'
'"bogus"'``)."""

from __future__ import annotations

import json
import sys

from mpi4py import MPI

from mpistrategy.strategy.mpi_ad import MPIADStrategy
from tests.strategy.helpers import Regressor, loader, mlp, regression_data, trainer

name, value, rank1_value = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
strategy = MPIADStrategy(**{name: rank1_value if MPI.COMM_WORLD.Get_rank() == 1 else value})
trainer(strategy=strategy, max_steps=2).fit(Regressor(mlp()), loader(regression_data(24), 4))
