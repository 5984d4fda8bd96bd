"""Results of the ops in recycled memory (the receive pool), 1-4 ranks: never aliasing a live result, exact
adjoints at pooled sizes, and the memory of a released result used again."""

from __future__ import annotations

import gc

import pytest
import torch

import mpistrategy as ms
from mpistrategy.comm.pool import receive_pool
from tests.adjoint import assert_adjoint, gather_reference, random_like_rank, rank, size

pytestmark = pytest.mark.mpi

N = 1 << 14  # float64 elements: 128 KiB per rank, above the pool's minimum size

OPS = {
    "allreduce": lambda t: ms.allreduce(t),
    "allgather": lambda t: ms.allgather(t),
    "broadcast": lambda t: ms.broadcast(t if rank() == 0 else None, root=0),
    "reduce_scatter": lambda t: ms.reduce_scatter(t),
}


def _expected(op: str, local: torch.Tensor) -> torch.Tensor:
    every = gather_reference(local)
    if op == "allreduce":
        return torch.stack(every).sum(0)
    if op == "allgather":
        return torch.cat(every)
    if op == "broadcast":
        return every[0]
    return torch.stack(every).sum(0).chunk(size())[rank()]


@pytest.mark.parametrize("op", sorted(OPS))
def test_results_held_at_once_never_share_memory(op: str) -> None:
    inputs = [random_like_rank((N * size(),), seed) for seed in range(6)]
    results = [OPS[op](x) for x in inputs]  # all alive together
    for x, result in zip(inputs, results, strict=True):
        torch.testing.assert_close(result, _expected(op, x), rtol=1e-12, atol=1e-12)
    addresses = {result.data_ptr() for result in results}
    assert len(addresses) == len(results)


@pytest.mark.parametrize("op", sorted(OPS))
def test_adjoint_at_a_pooled_size_over_repeated_calls(op: str) -> None:
    for seed in range(3):  # the later calls write into memory the earlier ones released
        assert_adjoint(OPS[op], random_like_rank((N * size(),), seed), seed=seed)


def test_a_released_result_is_received_into_again() -> None:
    gc.collect()  # the earlier tests' garbage freed now, not between the two calls (another storage freed there)
    x = random_like_rank((N,), seed=9)
    first = ms.allreduce(x)
    address = first.data_ptr()
    del first
    again = ms.allreduce(x)
    assert again.data_ptr() == address
    torch.testing.assert_close(again, _expected("allreduce", x), rtol=1e-12, atol=1e-12)
    assert receive_pool.held_bytes >= N * 8


def test_gradients_survive_the_next_step() -> None:
    """A gradient stored in ``.grad`` is live memory: the next step's results must land elsewhere."""
    weight = random_like_rank((N,), seed=3).requires_grad_(True)
    ms.allreduce(weight).sum().backward()
    first = weight.grad.clone()
    kept = weight.grad
    ms.allreduce(weight * 2).sum().backward()
    assert torch.equal(kept, weight.grad) and torch.equal(weight.grad, first * 3)


def test_a_kept_storage_object_is_live_memory() -> None:
    """``result.untyped_storage()`` held after the result is dropped still refers to the memory: the next results
    must land elsewhere and leave its values as they were."""
    x = random_like_rank((N,), seed=11)
    storage = ms.allreduce(x).untyped_storage()
    expected = _expected("allreduce", x)
    later = [ms.allreduce(x * 2) for _ in range(3)]
    assert all(result.data_ptr() != storage.data_ptr() for result in later)
    kept = torch.empty(0, dtype=x.dtype).set_(storage)
    torch.testing.assert_close(kept, expected, rtol=1e-12, atol=1e-12)
