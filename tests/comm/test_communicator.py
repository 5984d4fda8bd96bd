"""The wrapper of a user's communicator: cached on the communicator, new for a communicator created after another
was freed (MPI hands out freed handles again); a communicator mpistrategy duplicates for itself freed with all
it made on it (1-4 ranks)."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import mpistrategy as ms
from mpistrategy.comm.communicator import resolve
from tests.adjoint import rank, size
from tests.mpi_resources import free_context_ids

pytestmark = pytest.mark.mpi


def test_a_communicator_is_wrapped_once_and_its_duplicate_anew() -> None:
    duplicate = MPI.COMM_WORLD.Dup()
    try:
        wrapper = resolve(duplicate)
        assert resolve(duplicate) is wrapper and resolve(wrapper) is wrapper
        assert resolve(MPI.COMM_WORLD) is ms.world() is not wrapper
        for wrong in ("world", None, MPI.COMM_NULL):
            with pytest.raises(TypeError, match="expected an mpi4py intracommunicator"):
                ms.Communicator(wrong)
        again = duplicate.Dup()
        try:
            assert resolve(again) is not wrapper
        finally:
            again.Free()
    finally:
        duplicate.Free()


def test_ops_on_a_communicator_created_after_another_was_freed_run_on_its_own_members() -> None:
    """Split the world by rank parity, use and free it, then split it as a whole (or, every other round, in reverse
    order): MPI reuses the freed handle, and each op must still run over the new communicator's members."""
    for round_index in range(4):
        parity = MPI.COMM_WORLD.Split(color=rank() % 2, key=rank())
        halves = ms.allreduce(torch.tensor([float(rank() + 1)]), comm=parity)
        assert halves.item() == sum(r + 1 for r in range(size()) if r % 2 == rank() % 2)
        parity.Free()
        reverse = round_index % 2 == 1
        whole = MPI.COMM_WORLD.Split(color=0, key=-rank() if reverse else rank())
        try:
            total = ms.allreduce(torch.tensor([float(rank() + 1)]), comm=whole)
            assert total.item() == size() * (size() + 1) / 2
            order = list(range(size()))[::-1] if reverse else list(range(size()))
            gathered = ms.allgather(torch.tensor([float(rank())]), comm=whole)
            assert gathered.tolist() == [float(r) for r in order]
            root_value = ms.broadcast(torch.tensor([float(rank())]), root=0, comm=whole)
            assert root_value.item() == float(order[0])
        finally:
            whole.Free()


@pytest.mark.parametrize("shared_memory", ["on", "off"])
def test_freeing_an_own_communicator_frees_what_mpistrategy_made_on_it(shared_memory: str) -> None:
    """A communicator made for a wrapper (a sync mode's, a second model's gradient channels) gets three duplicates,
    shared-memory groups and (for the product) a reversed copy: ``free()`` frees them all, so that fits in one
    process do not exhaust MPI's context ids. Freeing twice is harmless."""
    ms.set_shared_memory(shared_memory)
    try:
        before = free_context_ids()
        for _ in range(40):
            own = ms.Communicator(MPI.COMM_WORLD.Dup())
            x = torch.full((3000,), float(rank() + 1), dtype=torch.float64, requires_grad=True)
            total = ms.allreduce(x, comm=own)
            product = ms.allreduce(x, op="prod", comm=own)
            (total.sum() + product.sum()).backward()
            assert total[0].item() == size() * (size() + 1) / 2
            own.free()
            own.free()
        assert free_context_ids() == before
    finally:
        ms.set_shared_memory("auto")
