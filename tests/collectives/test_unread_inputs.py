"""Torch's gradient rule for inputs an op does not read, on every op with such inputs and on ops whose inputs are
read but get a zero or empty gradient, at 1-4 ranks: an input the output does not depend on gets ``None``; an input
the op reads gets a gradient tensor of its shape."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import mpistrategy as ms
from mpistrategy import Placeholder
from tests.adjoint import random_like_rank, rank, size

pytestmark = pytest.mark.mpi


def _root() -> int:
    return size() - 1


def _at_root() -> bool:
    return rank() == _root()


def _always() -> bool:
    return True


def _left() -> int:
    return (rank() - 1) % size()


def _right() -> int:
    return (rank() + 1) % size()


def _values(rows: int) -> torch.Tensor:
    return random_like_rank((rows, 3), seed=1)


# name: (this rank's input, the op, whether the op reads this rank's input)
CASES: dict[str, tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], object], Callable[[], bool]]] = {
    "broadcast": (lambda: _values(2), lambda x: ms.broadcast(x, root=_root()), _at_root),
    "scatter": (lambda: _values(2 * size()), lambda x: ms.scatter(x, root=_root()), _at_root),
    "scatter_v": (lambda: _values(size()), lambda x: ms.scatter_v(x, root=_root(), sizes=[1] * size()), _at_root),
    "allreduce max (zero where others hold it)": (lambda: _values(4), lambda x: ms.allreduce(x, "max"), _always),
    "reduce prod to the last rank": (lambda: _values(2), lambda x: ms.reduce(x, root=_root(), op="prod"), _always),
    "gather to the last rank": (lambda: _values(2), lambda x: ms.gather(x, root=_root()), _always),
    "allgather_v (rank 0 sends no rows)": (lambda: _values(min(rank(), 2)), lambda x: ms.allgather_v(x), _always),
    "alltoall_v (nothing to the last rank)": (
        lambda: _values(size() - 1),
        lambda x: ms.alltoall_v(x, [1] * (size() - 1) + [0]),
        _always,
    ),
    "sendrecv": (lambda: _values(2), lambda x: ms.sendrecv(x, _right(), _left()), _always),
}


@pytest.mark.parametrize("name", list(CASES))
def test_unread_inputs_get_none_and_read_inputs_a_tensor(name: str) -> None:
    make, op, reads = CASES[name]
    x = make().requires_grad_(True)
    out = op(x)
    if isinstance(out, Placeholder):
        out.backward()
    else:
        out.backward(random_like_rank(tuple(out.shape), seed=2))
    if reads():
        assert x.grad is not None and x.grad.shape == x.shape
    else:
        assert x.grad is None


def test_autograd_grad_reports_a_non_root_broadcast_input_as_unused() -> None:
    """As for any torch op: ``torch.autograd.grad`` gives ``None`` with ``allow_unused=True``, and raises without."""
    x = _values(2).requires_grad_(True)
    (grad,) = torch.autograd.grad(ms.broadcast(x, root=_root()).sum(), [x], allow_unused=True)
    assert (grad is not None) == _at_root()
    if _at_root():
        assert torch.equal(grad, torch.full_like(x, float(size())))
    out = ms.broadcast(x, root=_root()).sum()
    if _at_root():
        torch.autograd.grad(out, [x])
    else:
        with pytest.raises(RuntimeError, match="not have been used"):
            torch.autograd.grad(out, [x])
