"""alltoall and alltoall_v on 1-4 ranks (run under the MPI harness)."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import mpistrategy as ms
from mpistrategy import CommunicationError
from tests.adjoint import assert_adjoint, gather_reference, rank, shape_along, size, strided

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
DTYPES = [torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.complex128]


def _assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype in (torch.float16, torch.bfloat16):
        actual, expected = actual.contiguous().view(torch.int16), expected.contiguous().view(torch.int16)
    assert torch.equal(actual, expected)


def _send_plan(sender: int, receiver: int) -> int:
    """How many slices ``sender`` sends to ``receiver`` in the uneven tests (0 for some pairs, e.g. 0 -> 0)."""
    return (sender + 2 * receiver) % 3


def _reference(everyone: list[torch.Tensor], sizes: list[list[int]], dim: int) -> torch.Tensor:
    """What this rank receives: block ``rank`` of every rank's tensor, in rank order."""
    return torch.cat([torch.split(x, sizes[s], dim=dim)[rank()] for s, x in enumerate(everyone)], dim=dim)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_alltoall_forward_and_adjoint(dim: int) -> None:
    x = strided(shape_along(dim % 2, 2 * size()), seed=1)
    assert not x.is_contiguous()
    out = ms.alltoall(x, dim=dim)
    _assert_bit_equal(out, _reference(gather_reference(x), [[2] * size()] * size(), dim))
    assert_adjoint(lambda t: ms.alltoall(t, dim=dim), x, seed=1)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("given", [False, True], ids=["learned", "given"])
def test_alltoall_v_forward_and_adjoint(dim: int, given: bool) -> None:
    plan = [[_send_plan(s, r) for r in range(size())] for s in range(size())]
    sends = plan[rank()]
    receives = [plan[s][rank()] for s in range(size())] if given else None
    x = strided(shape_along(dim, sum(sends)), seed=2)
    out = ms.alltoall_v(x, sends, dim=dim, recv_sizes=receives)
    _assert_bit_equal(out, _reference(gather_reference(x), plan, dim))
    assert_adjoint(lambda t: ms.alltoall_v(t, sends, dim=dim, recv_sizes=receives), x, seed=2)


def test_alltoall_v_with_an_empty_rank() -> None:
    """Rank 0 sends nothing at all and every rank sends rank 0 nothing."""
    plan = [[0 if 0 in (s, r) else r + s for r in range(size())] for s in range(size())]
    x = strided((2, 3, sum(plan[rank()])), seed=3)
    out = ms.alltoall_v(x, plan[rank()], dim=2)
    _assert_bit_equal(out, _reference(gather_reference(x), plan, 2))
    assert_adjoint(lambda t: ms.alltoall_v(t, plan[rank()], dim=2), x, seed=3)


def test_alltoall_backward_with_rank_weighted_loss() -> None:
    """Rank r weighs what it receives by 1 + r, so block r of every input gets gradient 1 + r."""
    x = strided((size(), 2), seed=4).requires_grad_(True)
    (ms.alltoall(x) * (1 + rank())).sum().backward()
    expected = torch.arange(1.0, size() + 1, dtype=torch.float64)[:, None].expand(-1, 2)
    assert torch.equal(x.grad, expected)


# gradcheck: every rank perturbs its own input element j at the same time and seeds backward with the same unit
# cotangent, so the Jacobians agree only for rank-local functions (rank r's output depends on rank r's input only).
# alltoall is its own inverse for equal blocks, so alltoall(alltoall(x) * w_r) is rank-local while every value visits
# another rank and is weighted there. Equal shapes keep the number of calls equal on every rank.


@pytest.mark.parametrize("dim", [0, 1])
def test_gradcheck_alltoall_there_and_back(dim: int) -> None:
    x = strided(shape_along(dim, size()), seed=5).requires_grad_(True)
    weight = 1 + rank() + torch.arange(3.0 * size(), dtype=torch.float64).reshape(shape_along(dim, size()))

    def function(t: torch.Tensor) -> torch.Tensor:
        return ms.alltoall(ms.alltoall(t, dim=dim) * weight, dim=dim)

    assert torch.autograd.gradcheck(function, (x,))


def test_gradcheck_alltoall_v_there_and_back() -> None:
    """The same with uneven blocks: sending back with the sizes swapped returns every slice home."""
    # A cyclic plan: uneven blocks, but every rank sends and receives the same total, so the number of elements
    # (and of gradcheck's calls) is the same on every rank.
    plan = [[1 + (r - s) % size() % 2 for r in range(size())] for s in range(size())]
    sends = plan[rank()]
    receives = [plan[s][rank()] for s in range(size())]
    x = strided((sum(sends), 2), seed=6).requires_grad_(True)
    weight = 1 + rank() + torch.arange(2.0 * sum(receives), dtype=torch.float64).reshape(sum(receives), 2)

    def function(t: torch.Tensor) -> torch.Tensor:
        return ms.alltoall_v(ms.alltoall_v(t, sends) * weight, receives)

    assert torch.autograd.gradcheck(function, (x,))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_move_bit_exactly(dtype: torch.dtype) -> None:
    x = strided((2 * size(), 3), seed=7, dtype=dtype)
    everyone = gather_reference(x)
    _assert_bit_equal(ms.alltoall(x), _reference(everyone, [[2] * size()] * size(), 0))
    plan = [[_send_plan(s, r) for r in range(size())] for s in range(size())]
    y = strided((3, sum(plan[rank()])), seed=8, dtype=dtype)
    _assert_bit_equal(ms.alltoall_v(y, plan[rank()], dim=1), _reference(gather_reference(y), plan, 1))


# errors: every rank raises, none is left waiting


def test_indivisible_length_raises_on_every_rank() -> None:
    if size() == 1:
        pytest.skip("every length is divisible by one rank")
    with pytest.raises(ValueError, match="not divisible"):
        ms.alltoall(torch.ones(size() + 1, 2))


def test_mismatched_shapes_raise_communication_error_on_every_rank() -> None:
    if size() == 1:
        pytest.skip("one rank cannot disagree with itself")
    with pytest.raises(CommunicationError, match="disagree"):
        ms.alltoall(torch.ones(size() * (1 + rank()), 2))
    with pytest.raises(CommunicationError, match="disagree"):
        ms.alltoall_v(torch.ones(2, 1 + rank()), [2] + [0] * (size() - 1))
    with pytest.raises(CommunicationError, match="requires_grad"):
        ms.alltoall(torch.ones(size(), requires_grad=rank() == 0))
    assert torch.equal(ms.alltoall(torch.ones(size(), 2)), torch.ones(size(), 2))


def test_bad_send_sizes_raise_on_every_rank() -> None:
    bad = [1] * size()
    bad[0] += rank() == size() - 1  # the sizes on the last rank do not add up to its length
    with pytest.raises((ValueError, CommunicationError), match="send_sizes|disagree"):
        ms.alltoall_v(torch.ones(size(), 2), bad)
    with pytest.raises(ValueError, match="send_sizes"):
        ms.alltoall_v(torch.ones(size(), 2), [1] * (size() + 1))


def test_wrong_recv_sizes_raise_on_every_rank() -> None:
    wrong = [1] * size()
    wrong[rank()] = 2  # the others send one slice each, and so does this rank to itself
    with pytest.raises(ValueError, match="recv_sizes"):
        ms.alltoall_v(torch.ones(size(), 2), [1] * size(), recv_sizes=wrong)


def test_wrong_recv_sizes_on_one_rank_raise_on_every_rank() -> None:
    if size() == 1:
        pytest.skip("one rank sends itself what it receives")
    culprit = rank() == size() - 1
    receives = [1] * size()
    receives[0] += culprit  # rank 0 sends one slice to the last rank, which expects two
    expected = (ValueError, "recv_sizes=") if culprit else (CommunicationError, rf"rank\(s\) \[{size() - 1}\]")
    with pytest.raises(expected[0], match=expected[1]):
        ms.alltoall_v(torch.ones(size(), 2), [1] * size(), recv_sizes=receives)
    assert torch.equal(ms.alltoall_v(torch.ones(size(), 2), [1] * size()), torch.ones(size(), 2))


@pytest.mark.parametrize("other", ["allreduce", "allgather_v", "broadcast", "alltoall", "alltoall_v given"])
def test_alltoall_v_on_one_rank_against_another_op_raises_on_every_rank(other: str) -> None:
    """The last rank calls alltoall_v (which exchanges its sizes after the check) while the others call another
    op: every rank raises naming both, nothing waits, and the ranks stay in step."""
    if size() == 1:
        pytest.skip("one rank cannot disagree with itself")
    x = torch.ones(size())
    calls = {
        "allreduce": lambda: ms.allreduce(x),
        "allgather_v": lambda: ms.allgather_v(x),
        "broadcast": lambda: ms.broadcast(x, root=0),
        "alltoall": lambda: ms.alltoall(x),
        "alltoall_v given": lambda: ms.alltoall_v(x, [1] * size(), recv_sizes=[1] * size()),
    }
    with pytest.raises(CommunicationError, match="alltoall_v"):
        ms.alltoall_v(x, [1] * size()) if rank() == size() - 1 else calls[other]()
    assert torch.equal(ms.allreduce(x), x * size())


def test_without_validation_the_count_exchange_still_reports_bad_sizes() -> None:
    ms.set_validation(False)
    try:
        bad = [1] * size()
        bad[0] += rank() == size() - 1
        with pytest.raises((ValueError, CommunicationError), match="send_sizes|invalid arguments"):
            ms.alltoall_v(torch.ones(size(), 2), bad)
        out = ms.alltoall_v(torch.ones(size(), 2), [1] * size())
    finally:
        ms.set_validation(True)
    assert torch.equal(out, torch.ones(size(), 2))


def test_scalar_and_bad_dim_raise_on_every_rank() -> None:
    with pytest.raises(ValueError, match="at least one dimension"):
        ms.alltoall(torch.tensor(1.0))
    with pytest.raises(ValueError, match="out of range"):
        ms.alltoall_v(torch.ones(size()), [1] * size(), dim=1)
    with pytest.raises(TypeError, match="dim"):
        ms.alltoall(torch.ones(size()), dim=0.5)
