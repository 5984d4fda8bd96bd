"""Harness case: a deadlock the watchdog must kill, then a test the harness must rerun."""

import pytest
from mpi4py import MPI


@pytest.mark.mpi(ranks=(2,), timeout=10)
def test_deadlocks() -> None:
    comm = MPI.COMM_WORLD
    comm.recv(source=1 - comm.rank)  # both ranks wait for a message nobody sends


@pytest.mark.mpi(ranks=(2,), timeout=10)
def test_passes_after_hang() -> None:
    MPI.COMM_WORLD.barrier()
