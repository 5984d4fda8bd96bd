"""``out=`` on allreduce, broadcast and allgather: results written into the caller's tensor (1-4 ranks)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity

import mpistrategy as ms
from mpistrategy import CommunicationError
from tests.adjoint import gather_reference, rank, size, strided

pytestmark = pytest.mark.mpi


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


def _largest_allocation(run) -> int:
    """The largest CPU allocation (bytes) made while ``run()`` executes."""
    with torch.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    return max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "in place"])
def test_allreduce_writes_into_out(op: str, layout: str) -> None:
    x = strided((3, 2), seed=1).contiguous()
    reference = torch.stack(gather_reference(x))
    expected = {"sum": reference.sum(0), "avg": reference.mean(0), "max": reference.amax(0)}[op]
    out = {"contiguous": torch.empty(3, 2, dtype=torch.float64), "transposed": torch.empty(2, 3).double().t()}.get(
        layout, x
    )
    pointer = out.data_ptr()
    result = ms.allreduce(x, op, out=out)
    assert result is out and out.data_ptr() == pointer
    _assert_close(out, expected)


def test_allreduce_out_in_bfloat16_is_reduced_in_float32() -> None:
    x = torch.full((5,), 1.0 + 2.0**-7 * (rank() + 1), dtype=torch.bfloat16)
    out = torch.empty(5, dtype=torch.bfloat16)
    ms.allreduce(x, out=out)
    exact = sum(float(t[0].float()) for t in gather_reference(x.float()))
    assert torch.equal(out, torch.full((5,), exact, dtype=torch.float32).to(torch.bfloat16))


def test_allreduce_and_allgather_into_out_allocate_no_result_buffer() -> None:
    x = torch.full((1 << 15,), float(rank() + 1), dtype=torch.float64)
    nbytes = x.numel() * x.element_size()
    reduced = torch.empty_like(x)
    gathered = torch.empty(size() * x.numel(), dtype=torch.float64)
    assert _largest_allocation(lambda: ms.allreduce(x, out=reduced)) < nbytes
    assert _largest_allocation(lambda: ms.allgather(x, out=gathered)) < nbytes
    _assert_close(reduced, torch.full_like(x, size() * (size() + 1) / 2))
    _assert_close(gathered, torch.arange(1, size() + 1, dtype=torch.float64).repeat_interleave(x.numel()))


def test_broadcast_into_out_on_receivers_and_in_place_on_the_root() -> None:
    root = size() - 1
    value = torch.arange(6.0).reshape(2, 3)
    out = value.clone() if rank() == root else torch.empty(2, 3)
    pointer = out.data_ptr()
    result = ms.broadcast(out if rank() == root else None, root=root, out=out)
    assert result is out and out.data_ptr() == pointer
    assert torch.equal(out, value)
    separate = torch.empty(2, 3)
    ms.broadcast(value if rank() == root else None, root=root, out=separate)
    assert torch.equal(separate, value) and separate.data_ptr() != value.data_ptr()


@pytest.mark.parametrize("dim", [0, 1])
def test_allgather_writes_into_out(dim: int) -> None:
    x = strided((2, 3), seed=4)
    expected = torch.cat(gather_reference(x), dim)
    out = torch.empty(expected.shape, dtype=torch.float64)
    pointer = out.data_ptr()
    assert ms.allgather(x, dim, out=out) is out and out.data_ptr() == pointer
    _assert_close(out, expected)


def test_out_with_autograd_raises_on_every_rank() -> None:
    x = torch.ones(3, requires_grad=True)
    out = torch.empty(3)
    with pytest.raises(ValueError, match="outside autograd"):
        ms.allreduce(x, out=out)
    with pytest.raises(ValueError, match="outside autograd"):
        ms.allgather(x, out=torch.empty(3 * size()))
    with pytest.raises(ValueError if rank() == 0 else CommunicationError, match="outside autograd"):
        ms.broadcast(x if rank() == 0 else None, root=0, out=out)  # refused on the root: every rank raises
    with pytest.raises(ValueError if rank() == size() - 1 else CommunicationError, match="outside autograd"):
        ms.broadcast(x if rank() == 0 else None, root=0, out=out if rank() == size() - 1 else None)
    with torch.no_grad():
        assert torch.equal(ms.allreduce(x, out=out), torch.full((3,), float(size())))


def test_out_of_the_wrong_shape_or_dtype_raises() -> None:
    """Where the result's shape is known before communicating, before it (on every rank); on broadcast's receivers,
    which learn it from the root, after the broadcast, on the rank with the bad out alone."""
    x = torch.ones(4)
    with pytest.raises(ValueError, match=r"out= has shape \(3,\).*result has shape \(4,\)"):
        ms.allreduce(x, out=torch.empty(3))
    with pytest.raises(ValueError if rank() == 0 else CommunicationError, match="dtype torch.float64"):
        ms.broadcast(x if rank() == 0 else None, root=0, out=torch.empty(4, dtype=torch.float64))
    wrong = torch.empty(5)
    if rank() == size() - 1 and size() > 1:
        with pytest.raises(ValueError, match=r"out= has shape \(5,\)"):
            ms.broadcast(None, root=0, out=wrong)
    else:
        assert torch.equal(ms.broadcast(x if rank() == 0 else None, root=0), x)
    with pytest.raises(TypeError, match="out= must be a torch.Tensor"):
        ms.allgather(x, out=[0.0] * 4)
    assert torch.equal(ms.allreduce(x), torch.full((4,), float(size())))  # the ranks are still in step


@pytest.mark.parametrize("blocking", [True, False], ids=["allreduce", "iallreduce"])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_allreduce_into_an_out_that_partly_overlaps_the_input(op: str, blocking: bool) -> None:
    """out=buf[1:] for the input buf[:6]: MPI must not see overlapping buffers (MPICH aborts the job)."""
    buffer = torch.arange(7.0, dtype=torch.float64) + rank()
    x, out = buffer[:6], buffer[1:]
    inputs = torch.stack(gather_reference(x))
    expected = inputs.sum(0) if op == "sum" else inputs.amax(0)
    result = ms.allreduce(x, op, out=out) if blocking else ms.iallreduce(x, "sum", out=out).wait()
    assert result is out
    _assert_close(out, expected if blocking else inputs.sum(0))
    assert buffer[0] == rank()  # outside out: untouched


@pytest.mark.parametrize("dim", [0, 1])
def test_allgather_in_place_from_this_ranks_block_of_out(dim: int) -> None:
    """torch.distributed.all_gather_into_tensor(out, out.chunk(P)[rank]), as FSDP and ZeRO gather parameters."""
    out = torch.zeros(2 * size(), 3).movedim(0, dim).contiguous()
    x = out.chunk(size(), dim)[rank()]
    x.copy_(strided(tuple(x.shape), seed=9, dtype=torch.float32))
    expected = torch.cat(gather_reference(x), dim)
    assert ms.allgather(x, dim, out=out) is out
    assert torch.equal(out, expected)  # on one rank, x is all of out


def test_broadcast_root_into_an_out_that_partly_overlaps_its_tensor() -> None:
    root = size() - 1
    buffer = torch.arange(7.0)
    tensor, out = (buffer[:6], buffer[1:]) if rank() == root else (None, torch.empty(6))
    assert ms.broadcast(tensor, root=root, out=out) is out
    assert torch.equal(out, torch.arange(6.0))


@pytest.mark.parametrize("blocking", [True, False], ids=["allreduce", "iallreduce"])
@pytest.mark.parametrize("numel", [5, 1 << 17])
def test_ranks_reducing_in_place_and_into_new_tensors_in_one_call(numel: int, blocking: bool) -> None:
    """``out=x`` on some ranks, a new result or another ``out`` on the others: one allreduce, the same sums."""
    x = torch.arange(numel, dtype=torch.float64) * (rank() + 1)
    expected = torch.arange(numel, dtype=torch.float64) * (size() * (size() + 1) / 2)
    out = {0: x, 1: None}.get(rank() % 3, torch.empty(numel, dtype=torch.float64))
    result = ms.allreduce(x, out=out) if blocking else ms.iallreduce(x, out=out).wait()
    assert out is None or result is out
    _assert_close(result, expected)
