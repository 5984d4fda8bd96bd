"""Tensors with torch's lazy conjugate or negative bit (``x.conj()``, ``torch._neg_view(x)``, and the conjugated
cotangent autograd hands backward for a loss written with ``y.conj()``): their memory does not hold their values,
so every op must send the values, not the memory (1-4 ranks)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import mpistrategy as ms
from tests.adjoint import rank, size

pytestmark = pytest.mark.mpi


def _wrapped(result: torch.Tensor | ms.Placeholder) -> torch.Tensor:
    """An op's result; a rank that holds none (a root op's non-root) gets a zero-length tensor."""
    return result if isinstance(result, torch.Tensor) else torch.zeros(0, dtype=torch.complex128)


def _v_sizes() -> list[int]:
    return [2 + other % 2 for other in range(size())]


OPS: dict[str, Callable[[torch.Tensor], torch.Tensor | ms.Placeholder]] = {
    "allreduce": lambda x: ms.allreduce(x),
    "iallreduce": lambda x: ms.iallreduce(x).wait(),
    "allreduce prod": lambda x: ms.allreduce(x, op="prod"),
    "reduce": lambda x: ms.reduce(x, root=size() - 1),
    "reduce_scatter": lambda x: ms.reduce_scatter(x, dim=1),
    "reduce_scatter_v": lambda x: ms.reduce_scatter_v(x[:, : sum(_v_sizes())].contiguous(), _v_sizes(), dim=1),
    "broadcast": lambda x: ms.broadcast(x, root=size() - 1),
    "gather": lambda x: ms.gather(x, root=0, dim=1),
    "gather_v": lambda x: ms.gather_v(x[:, : _v_sizes()[rank()]], root=0, dim=1),
    "scatter": lambda x: ms.scatter(x, root=0, dim=1),
    "scatter_v": lambda x: ms.scatter_v(x[:, : sum(_v_sizes())], root=0, dim=1, sizes=_v_sizes()),
    "allgather": lambda x: ms.allgather(x, dim=1),
    "allgather_v": lambda x: ms.allgather_v(x[:, : _v_sizes()[rank()]], dim=1),
    "alltoall": lambda x: ms.alltoall(x, dim=1),
    "alltoall_v": lambda x: ms.alltoall_v(x[:, : 2 * size()], [2] * size(), dim=1),
    "sendrecv": lambda x: ms.sendrecv(x, (rank() + 1) % size(), (rank() - 1) % size()),
}


def _input(dtype: torch.dtype) -> torch.Tensor:
    """A (2, 3 * size) tensor, different on every rank (rank 0's plain values differ from their conjugates)."""
    generator = torch.Generator().manual_seed(7 + rank())
    return torch.randn(2, 3 * size(), dtype=dtype, generator=generator)


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("bit", ["conj", "neg"])
def test_an_input_with_a_lazy_bit_sends_its_values(name: str, bit: str) -> None:
    dtype = torch.complex128 if bit == "conj" else torch.float64
    x = _input(dtype)
    lazy = x.conj() if bit == "conj" else torch._neg_view(x)
    assert lazy.is_conj() or lazy.is_neg()
    expected = _wrapped(OPS[name](lazy.resolve_conj().resolve_neg()))
    torch.testing.assert_close(_wrapped(OPS[name](lazy)), expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(OPS))
def test_a_conjugated_cotangent_gives_the_gradient_of_the_same_loss_written_without_it(name: str) -> None:
    """``Re(sum(conj(y) * c))`` (autograd hands the op's backward a cotangent with the conjugate bit) and
    ``sum(Re y * Re c + Im y * Im c)`` (no bit anywhere) are one function of ``x``: the gradients agree."""
    c = torch.randn(1024, dtype=torch.complex128, generator=torch.Generator().manual_seed(100 + rank()))

    def gradient(loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        x = _input(torch.complex128).requires_grad_()
        y = OPS[name](x)
        if isinstance(y, ms.Placeholder):
            y.backward()
        else:
            loss(y, c[: y.numel()].reshape(y.shape)).backward()
        assert x.grad is not None or name in ("broadcast", "scatter", "scatter_v")
        return x.grad if x.grad is not None else torch.zeros_like(x)

    lazy = gradient(lambda y, c: (y.conj() * c).real.sum())
    plain = gradient(lambda y, c: (y.real * c.real + y.imag * c.imag).sum())
    torch.testing.assert_close(lazy, plain, rtol=1e-12, atol=1e-12)
    assert lazy.abs().sum() > 0 or rank() != 0 or name in ("broadcast",)


OUT_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]] = {
    "allreduce": lambda x, out: ms.allreduce(x, out=out),
    "broadcast": lambda x, out: ms.broadcast(x, root=0, out=out),
    "allgather": lambda x, out: ms.allgather(x, out=out),
}


@pytest.mark.parametrize("name", sorted(OUT_OPS))
def test_out_with_a_lazy_conjugate_bit_receives_the_result(name: str) -> None:
    x = _input(torch.complex128)
    expected = OUT_OPS[name](x, None)
    out = torch.zeros_like(expected).conj()
    result = OUT_OPS[name](x, out)
    assert result is out and out.is_conj()
    torch.testing.assert_close(out.resolve_conj(), expected, rtol=0, atol=0)
