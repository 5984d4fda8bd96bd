"""Shared checks for differentiable collectives: the adjoint dot-product test and random per-rank data."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from mpi4py import MPI

from mpistrategy import Placeholder


def rank_generator(seed: int, comm: MPI.Comm = MPI.COMM_WORLD) -> torch.Generator:
    """A generator seeded differently on every rank, so inputs and cotangents differ per rank."""
    return torch.Generator().manual_seed(1000 * seed + comm.Get_rank())


def random_like_rank(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A random tensor of ``shape`` that differs on every rank."""
    return torch.randn(shape, dtype=dtype, generator=rank_generator(seed))


def assert_adjoint(
    forward: Callable[[torch.Tensor], torch.Tensor | Placeholder],
    x: torch.Tensor,
    seed: int = 0,
    comm: MPI.Comm = MPI.COMM_WORLD,
    rel_tol: float = 1e-10,
) -> tuple[float, float]:
    """Check ``sum_r <A x, y>_r == sum_r <x, A^T y>_r`` with a random cotangent ``y`` on every rank.

    ``A`` is ``forward`` applied on every rank, ``A^T y`` is what its backward computes. Ranks whose output is
    a :class:`Placeholder` contribute no cotangent but still run backward. Returns ``(lhs, rhs)``.
    """
    x = x.detach().clone().requires_grad_(True)
    out = forward(x)
    if isinstance(out, Placeholder):
        lhs_local = 0.0
        out.backward()
    else:
        y = torch.randn(out.shape, dtype=out.dtype, generator=rank_generator(seed + 7919, comm))
        lhs_local = float((out.detach() * y).sum())
        out.backward(y)
    rhs_local = float((x.detach() * x.grad).sum()) if x.grad is not None else 0.0
    lhs = comm.allreduce(lhs_local)
    rhs = comm.allreduce(rhs_local)
    assert math.isclose(lhs, rhs, rel_tol=rel_tol, abs_tol=1e-12), f"adjoint test failed: <Ax,y>={lhs} <x,A^T y>={rhs}"
    return lhs, rhs


def gather_reference(local: torch.Tensor, comm: MPI.Comm = MPI.COMM_WORLD) -> list[torch.Tensor]:
    """Every rank's ``local`` tensor on every rank, by mpi4py's pickle-based allgather (the reference)."""
    return [torch.as_tensor(t) for t in comm.allgather(local.detach().clone())]


def rank(comm: MPI.Comm = MPI.COMM_WORLD) -> int:
    return comm.Get_rank()


def size(comm: MPI.Comm = MPI.COMM_WORLD) -> int:
    return comm.Get_size()


def strided(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A random per-rank tensor of ``shape`` whose memory is laid out in reverse order (not contiguous)."""
    base = random_like_rank(tuple(reversed(shape)), seed)
    if dtype == torch.bool:
        base = base > 0
    elif not dtype.is_floating_point and not dtype.is_complex:
        base = (base * 1000).round()
    return base.to(dtype).permute(*reversed(range(len(shape))))


def shape_along(dim: int, length: int, other: int = 3) -> tuple[int, int]:
    """A 2-D shape whose dimension ``dim`` has ``length`` elements."""
    return (length, other) if dim == 0 else (other, length)
