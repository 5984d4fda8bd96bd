"""Second derivatives through the collectives (``create_graph=True``) on 1-4 ranks (run under the MPI harness).

A gradient penalty differentiated through each op that supports it equals the one a single process computes over
every rank's data; the adjoint of each op's backward is the op again; the ops that do not support it raise on every
rank in the backward pass, before anything is sent."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from mpi4py import MPI

import mpistrategy as ms
from tests.adjoint import gather_reference, random_like_rank, rank, size

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD

Distributed = Callable[[torch.Tensor], torch.Tensor]
#: rank r's output from every rank's input (a list indexed by rank) and r
Reference = Callable[[list[torch.Tensor], int], torch.Tensor]


def _lengths(base: int) -> list[int]:
    """Uneven lengths per rank (one may be 0)."""
    return [(base + 2 * r) % 4 for r in range(size())]


def _alltoall_sizes(source: int) -> list[int]:
    """The block lengths rank ``source`` sends to each rank in the alltoall_v case."""
    return [(source + destination) % 3 for destination in range(size())]


def _alltoall_v_reference(xs: list[torch.Tensor], r: int) -> torch.Tensor:
    return torch.cat([x.split(_alltoall_sizes(s), 0)[r] for s, x in enumerate(xs)], 0)


#: name -> (the op on this rank, its single-process reference, this rank's input shape)
CASES: dict[str, tuple[Distributed, Reference, Callable[[], tuple[int, ...]]]] = {
    "allreduce sum": (lambda x: ms.allreduce(x, "sum"), lambda xs, r: sum(xs), lambda: (3, 2)),
    "allreduce avg": (lambda x: ms.allreduce(x, "avg"), lambda xs, r: sum(xs) / len(xs), lambda: (3, 2)),
    "allreduce max": (lambda x: ms.allreduce(x, "max"), lambda xs, r: torch.stack(xs).amax(0), lambda: (3, 2)),
    "allreduce min": (lambda x: ms.allreduce(x, "min"), lambda xs, r: torch.stack(xs).amin(0), lambda: (3, 2)),
    "iallreduce sum": (lambda x: ms.iallreduce(x, "sum").wait(), lambda xs, r: sum(xs), lambda: (3, 2)),
    "iallreduce avg": (lambda x: ms.iallreduce(x, "avg").wait(), lambda xs, r: sum(xs) / len(xs), lambda: (4,)),
    "allgather dim 0": (lambda x: ms.allgather(x, 0), lambda xs, r: torch.cat(xs, 0), lambda: (2, 3)),
    "allgather dim 1": (lambda x: ms.allgather(x, 1), lambda xs, r: torch.cat(xs, 1), lambda: (2, 3)),
    "allgather_v": (lambda x: ms.allgather_v(x, 0), lambda xs, r: torch.cat(xs, 0), lambda: (_lengths(1)[rank()], 2)),
    "reduce_scatter sum": (
        lambda x: ms.reduce_scatter(x, 1, "sum"),
        lambda xs, r: sum(xs).chunk(len(xs), 1)[r],
        lambda: (2, 2 * size()),
    ),
    "reduce_scatter avg": (
        lambda x: ms.reduce_scatter(x, 0, "avg"),
        lambda xs, r: (sum(xs) / len(xs)).chunk(len(xs), 0)[r],
        lambda: (size(), 3),
    ),
    "reduce_scatter_v": (
        lambda x: ms.reduce_scatter_v(x, _lengths(2), 0, "sum"),
        lambda xs, r: sum(xs).split(_lengths(2), 0)[r],
        lambda: (sum(_lengths(2)), 2),
    ),
    "alltoall": (
        lambda x: ms.alltoall(x, 1),
        lambda xs, r: torch.cat([x.chunk(len(xs), 1)[r] for x in xs], 1),
        lambda: (2, 2 * size()),
    ),
    "alltoall_v": (
        lambda x: ms.alltoall_v(x, _alltoall_sizes(rank()), 0),
        _alltoall_v_reference,
        lambda: (sum(_alltoall_sizes(rank())), 2),
    ),
}


def _penalty_gradient(output: Callable[[], torch.Tensor], x: torch.Tensor, w: torch.Tensor, v: torch.Tensor):
    """The gradient ``g`` of ``L = <w, y^3> + |x|^2`` (y the op's output) with ``create_graph=True``, and the
    gradient of the penalty ``<v, g^2>`` with respect to ``x``."""
    y = output()
    loss = (w * y**3).sum() + (x**2).sum()
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    (h,) = torch.autograd.grad((v * g**2).sum(), x)
    return g.detach(), h


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_gradient_penalty_equals_one_process_over_every_ranks_data(case: str) -> None:
    """With the sum-of-losses convention, rank r's ``g_r = dL/dx_r`` and ``h_r = d(sum_s <v_s, g_s^2>)/dx_r`` for
    ``L = sum_s (<w_s, y_s^3> + |x_s|^2)``: both equal what one process computes over the list of every rank's data
    (float64)."""
    op, reference, shape = CASES[case]
    x = random_like_rank(shape(), seed=1).requires_grad_(True)
    y_shape = op(x.detach()).shape
    w, v = random_like_rank(y_shape, seed=2), random_like_rank(shape(), seed=3)
    g, h = _penalty_gradient(lambda: op(x), x, w, v)

    xs = [t.requires_grad_(True) for t in gather_reference(x)]
    ws, vs = gather_reference(w), gather_reference(v)
    loss = sum((ws[r] * reference(xs, r) ** 3).sum() + (xs[r] ** 2).sum() for r in range(size()))
    gs = torch.autograd.grad(loss, xs, create_graph=True)
    hs = torch.autograd.grad(sum((vs[r] * gs[r] ** 2).sum() for r in range(size())), xs)
    torch.testing.assert_close(g, gs[rank()].detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h, hs[rank()], rtol=1e-10, atol=1e-10)


#: the linear ops, each with its input shape on this rank (the tensor-parallel pair, whose loss counts once, too)
LINEAR: dict[str, tuple[Distributed, Callable[[], tuple[int, ...]]]] = {
    **{name: (op, shape) for name, (op, _, shape) in CASES.items() if not name.startswith("allreduce m")},
    "copy_to_parallel": (ms.copy_to_parallel, lambda: (3, 2)),
    "reduce_from_parallel": (ms.reduce_from_parallel, lambda: (3, 2)),
}


@pytest.mark.parametrize("case", sorted(LINEAR))
def test_the_backward_of_the_backward_is_the_op_itself(case: str) -> None:
    """For a linear op ``A``: the backward maps a cotangent ``u`` to ``A^T u``; differentiating ``<A^T u, v>`` with
    respect to ``u`` gives ``A v``, which must equal the op applied to ``v`` (float64, random per-rank data)."""
    op, shape = LINEAR[case]
    x = random_like_rank(shape(), seed=4).requires_grad_(True)
    out = op(x)
    u = random_like_rank(out.shape, seed=5).requires_grad_(True)
    (transposed,) = torch.autograd.grad(out, x, grad_outputs=u, create_graph=True)
    v = random_like_rank(x.shape, seed=6)
    (again,) = torch.autograd.grad((transposed * v).sum(), u)
    torch.testing.assert_close(again, op(v), rtol=1e-12, atol=1e-12)


#: ops whose gradient cannot be differentiated again, each with this rank's use of it
REFUSING: dict[str, Distributed] = {
    "broadcast": lambda x: ms.broadcast(x, root=0),
    "reduce": lambda x: ms.reduce(x, root=0, op="sum"),
    "gather": lambda x: ms.gather(x, root=size() - 1),
    "scatter": lambda x: ms.scatter(x.repeat(size()), root=0),
    "allreduce op='prod'": lambda x: ms.allreduce(x, "prod"),
    "iallreduce op='prod'": lambda x: ms.iallreduce(x, "prod").wait(),
    "reduce_scatter op='prod'": lambda x: ms.reduce_scatter(x.repeat(size()), 0, "prod"),
    "sendrecv": lambda x: ms.sendrecv(x, dst=(rank() + 1) % size(), src=(rank() - 1) % size()),
}


def _refusing_loss(case: str, x: torch.Tensor) -> torch.Tensor:
    """A loss through the op (a Placeholder where this rank holds no result), also using ``x`` directly."""
    out = REFUSING[case](x)
    through = out.sum() ** 2 if isinstance(out, torch.Tensor) else out
    return through + 0.0 * x.sum()


@pytest.mark.parametrize("case", sorted(REFUSING))
def test_ops_without_second_derivatives_refuse_create_graph_on_every_rank(case: str) -> None:
    x = random_like_rank((3,), seed=7).requires_grad_(True)
    with pytest.raises(RuntimeError, match=f"^{re.escape(case)}: its gradient cannot be differentiated again"):
        torch.autograd.grad(_refusing_loss(case, x), x, create_graph=True)
    (first,) = torch.autograd.grad(_refusing_loss(case, x), x)  # first derivatives still work: the ranks are in step
    assert first.shape == x.shape and COMM.allreduce(1) == size()


TRANSFORMED: dict[str, tuple[str, Distributed]] = {
    "allreduce": ("allreduce", lambda x: ms.allreduce(2 * x)),
    "reduce_scatter_v": ("reduce_scatter", lambda x: ms.reduce_scatter_v(2 * x)),
    "iallreduce": ("a non-blocking op", lambda x: ms.iallreduce(2 * x).wait()),
    "sendrecv": ("send_recv", lambda x: ms.sendrecv(2 * x, dst=(rank() + 1) % size(), src=(rank() - 1) % size())),
}
_UNSUPPORTED = "called inside a torch.func transform"


@pytest.mark.parametrize("case", sorted(TRANSFORMED))
def test_torch_func_transforms_are_refused_on_every_rank(case: str) -> None:
    """vmap and jacrev reach the op's forward with wrapped tensors, jacobian(vectorize=True) its backward with
    batched cotangents: each raises an error naming the op and the fix before anything is sent, and the loop-based
    jacobian (vectorize=False) still works: sum_r d(y_r . e_i)/dx on this rank, 2P times the identity for allreduce."""
    backward_name, op = TRANSFORMED[case]
    x = random_like_rank((size(),), seed=5, dtype=torch.float64)
    with pytest.raises(TypeError, match=f"^{case}: {_UNSUPPORTED}"):
        torch.func.vmap(op)(x.unsqueeze(0))
    with pytest.raises(TypeError, match=f"^{case}: {_UNSUPPORTED}"):
        torch.func.jacrev(op)(x)
    with pytest.raises(TypeError, match=f"^the backward of {backward_name}: {_UNSUPPORTED}.*vectorize=False"):
        torch.autograd.functional.jacobian(op, x, vectorize=True)
    jacobian = torch.autograd.functional.jacobian(op, x)
    if case == "allreduce":
        torch.testing.assert_close(jacobian, 2.0 * size() * torch.eye(size(), dtype=torch.float64))
    assert jacobian.shape[1:] == x.shape and COMM.allreduce(1) == size()
