"""Harness case: a test failing on the last rank, then tests the harness must rerun after the abort."""

import pytest
from mpi4py import MPI


@pytest.mark.mpi(ranks=(3,), timeout=10)
def test_fails_on_last_rank() -> None:
    comm = MPI.COMM_WORLD
    total = comm.allreduce(comm.rank)
    assert comm.rank < comm.size - 1, f"deliberate failure on rank {comm.rank} (total {total})"


@pytest.mark.mpi(ranks=(3,), timeout=10)
def test_passes_after_failure() -> None:
    comm = MPI.COMM_WORLD
    assert comm.allreduce(1) == comm.size


@pytest.mark.mpi(ranks=(3,), timeout=10)
def test_skipped_on_every_rank() -> None:
    pytest.skip("deliberate skip")
