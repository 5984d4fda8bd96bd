"""Harness case: a rank exits abruptly without reporting."""

import os

import pytest
from mpi4py import MPI


@pytest.mark.mpi(ranks=(2,), timeout=10)
def test_rank_exits_abruptly() -> None:
    comm = MPI.COMM_WORLD
    if comm.rank == 1:
        os._exit(3)
    comm.barrier()
