"""The background progress of non-blocking requests: a transfer in flight completes while its caller makes no MPI
call, and the requests are the caller's again after ``stop`` (2-4 ranks)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

from mpistrategy.comm.progress import Progress, drive

pytestmark = pytest.mark.mpi(ranks=(2, 3, 4), timeout=120)

COMM = MPI.COMM_WORLD
ELEMENTS = 4 << 20  # 16 MB of float32: far beyond what MPI sends eagerly, so it needs progress on both sides


def _ring_exchange() -> tuple[np.ndarray, np.ndarray, list[MPI.Request]]:
    rank, size = COMM.Get_rank(), COMM.Get_size()
    sent = np.full(ELEMENTS, rank, dtype=np.float32)
    received = np.empty(ELEMENTS, dtype=np.float32)
    requests = [
        COMM.Irecv(received, source=(rank - 1) % size, tag=7),
        COMM.Isend(sent, dest=(rank + 1) % size, tag=7),
    ]
    return sent, received, requests


def test_a_transfer_completes_while_the_caller_computes() -> None:
    _, received, requests = _ring_exchange()
    progress = drive(requests)
    assert isinstance(progress, Progress)
    deadline = time.monotonic() + 60.0
    while not progress.completed and time.monotonic() < deadline:
        time.sleep(0.01)  # no MPI call on this thread
    completed = progress.completed
    progress.stop()
    assert completed, "the transfer did not complete without the caller's MPI calls"
    assert all(r == MPI.REQUEST_NULL for r in requests)
    assert np.all(received == (COMM.Get_rank() - 1) % COMM.Get_size())
    COMM.Barrier()


def test_stopped_early_the_caller_completes_the_requests() -> None:
    COMM.Barrier()
    _, received, requests = _ring_exchange()
    progress = drive(requests, interval=10.0)  # it would not test before being stopped
    assert progress is not None
    progress.stop()
    assert not progress.completed
    MPI.Request.Waitall(requests)
    assert np.all(received == (COMM.Get_rank() - 1) % COMM.Get_size())


def test_nothing_to_drive() -> None:
    assert drive([]) is None
