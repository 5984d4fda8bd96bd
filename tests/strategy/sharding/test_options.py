"""``shard=`` that cannot run fails with an error naming the problem and the fix, on every rank, and no rank hangs:
an unknown mode, a sync mode or aggregator it cannot run with, uneven nodes for hierarchical stage 2, ranks given
different values, and a wrong value on one rank only (which ends the job)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpistrategy.aggregation import TopK
from mpistrategy.launch import mpiexec_command
from mpistrategy.strategy.mpi_ad import MPIADStrategy
from mpistrategy.sync import SyncConfigurationError
from tests.mpi_harness import clean_environ
from tests.strategy.helpers import COMM, RANK, SIZE, Regressor, loader, mlp, regression_data, trainer

SCRIPT = Path(__file__).parent / "scripts" / "bad_shard_job.py"


def _fit(strategy: MPIADStrategy) -> None:
    trainer(strategy=strategy, max_steps=2).fit(Regressor(mlp()), loader(regression_data(SIZE * 8), 4))


def _still_in_step() -> None:
    assert COMM.allreduce(RANK) == SIZE * (SIZE - 1) // 2


@pytest.mark.mpi(ranks=(3,), timeout=120)
def test_an_unknown_mode_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"shard='bogus' is not a shard mode; use 'optimizer', 'gradients'"):
        MPIADStrategy(shard="bogus")
    with pytest.raises(ValueError, match="data_parallel=False keeps no replicas"):
        MPIADStrategy(shard="optimizer", data_parallel=False)
    _still_in_step()


@pytest.mark.mpi(ranks=(3,), timeout=120)
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"shard": "optimizer", "sync": "local_sgd"}, r"sync mode 'local_sgd' keeps replicas that differ"),
        ({"shard": "gradients", "sync": "daso"}, r"sync mode 'daso' keeps replicas that differ"),
        ({"shard": "gradients", "aggregator": TopK(density=0.1)}, r"aggregator is TopK.*or shard='optimizer'"),
        ({"shard": "gradients", "sync": "hierarchical", "ranks_per_node": 2}, r"the nodes have \[2, 1\] ranks"),
    ],
    ids=["local_sgd", "daso", "compressor", "uneven-nodes"],
)
def test_a_configuration_it_cannot_run_fails_on_every_rank(options: dict, message: str) -> None:
    with pytest.raises(SyncConfigurationError, match=message):
        _fit(MPIADStrategy(**options))
    _still_in_step()


@pytest.mark.mpi(ranks=(3,), timeout=120)
def test_ranks_given_different_modes_fail_together() -> None:
    with pytest.raises(SyncConfigurationError, match=r"rank 0: 'gradients', rank 1: None, rank 2: None"):
        _fit(MPIADStrategy(shard="gradients" if RANK == 0 else None))
    _still_in_step()


@pytest.mark.skipif(
    os.environ.get("MPISTRATEGY_TEST_NRANKS") is not None or "PMI_RANK" in os.environ,
    reason="launches its own mpiexec; run from the plain (outer) pytest",
)
def test_an_unknown_mode_on_one_rank_only_ends_the_job() -> None:
    env = clean_environ()
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[3]), env.get("PYTHONPATH", "")])
    start = time.time()
    done = subprocess.run(
        [*mpiexec_command(), "-n", "3", sys.executable, str(SCRIPT)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert "shard='bogus' is not a shard mode" in output and "[mpistrategy] rank 1 of 3" in output, output[-3000:]
    assert time.time() - start < 280
