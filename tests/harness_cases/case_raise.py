"""Harness case: rank 0 raises while rank 1 already waits in a collective."""

import pytest
from mpi4py import MPI


@pytest.mark.mpi(ranks=(2,), timeout=10)
def test_raises_before_collective() -> None:
    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        raise RuntimeError("deliberate error before the allreduce")
    comm.allreduce(comm.rank)
