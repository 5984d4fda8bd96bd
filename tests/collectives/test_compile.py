"""Collectives inside torch.compile'd code equal eager code: values and gradients (each op is a graph break and runs
eagerly; see mpistrategy/collectives/_compile.py)."""

from __future__ import annotations

import pytest
import torch

import mpistrategy as ms
from mpistrategy import Placeholder
from tests.adjoint import random_like_rank, rank, size

pytestmark = pytest.mark.mpi(ranks=(2,), timeout=300)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


class Gathering(torch.nn.Module):
    """A layer, the mean over ranks of its output, and the outputs of every rank side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(5, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.linear(x))
        mean = ms.allreduce(hidden, "avg")
        return ms.allgather(hidden * mean, dim=1)


def test_compiled_module_with_allreduce_and_allgather_equals_eager() -> None:
    torch.manual_seed(0)
    eager = Gathering()
    compiled_copy = Gathering()
    compiled_copy.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_copy)
    for step in range(2):  # the second call runs the cached compiled code
        x = random_like_rank((3, 5), seed=10 + step)
        weight = random_like_rank((3, 4 * size()), seed=20 + step)  # a different loss on every rank
        expected, actual = eager(x), compiled(x)
        _assert_close(actual, expected)
        (expected * weight).sum().backward()
        (actual * weight).sum().backward()
        for name, parameter in eager.named_parameters():
            _assert_close(compiled_copy.get_parameter(name).grad, parameter.grad)


def _every_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A loss through every family of ops: reductions (prod too), a non-blocking handle, broadcast, reduce with a
    placeholder, scatter, all-to-all and point-to-point."""
    root = size() - 1
    h = torch.tanh(x @ w)
    total = ms.allreduce(h) + ms.iallreduce(h * 2, "avg").wait() + ms.allreduce(h, "prod")
    shared = ms.broadcast(h if rank() == root else None, root=root)
    reduced = ms.reduce(h, root=root)
    block = ms.scatter(torch.cat([h] * size()) if rank() == root else None, root=root)
    exchanged = ms.alltoall(torch.cat([h] * size()))
    received = ms.sendrecv(h, (rank() + 1) % size(), (rank() - 1) % size())
    loss = (total**2).sum() + (shared * received).sum() + (block * exchanged[: h.shape[0]]).sum()
    return loss + (reduced if isinstance(reduced, Placeholder) else (reduced**2).sum() * (1 + rank()))


def test_compiled_function_through_every_op_family_equals_eager() -> None:
    x = random_like_rank((2, 3), seed=30)
    w = random_like_rank((3, 3), seed=31)
    w_eager, w_compiled = w.clone().requires_grad_(True), w.clone().requires_grad_(True)
    expected = _every_op(x, w_eager)
    actual = torch.compile(_every_op)(x, w_compiled)
    _assert_close(actual, expected)
    expected.backward()
    actual.backward()
    _assert_close(w_compiled.grad, w_eager.grad)
