"""copy_to_parallel and reduce_from_parallel on 1-4 ranks (run under the MPI harness).

These two ops follow the identity-backward convention of tensor parallelism: the value they replicate or produce is
one shared value whose loss counts once, not once per rank. Their checks are against a single-process layer.
"""

from __future__ import annotations

import math

import pytest
import torch
from mpi4py import MPI

import mpistrategy as ms
from mpistrategy import CommunicationError
from tests.adjoint import gather_reference, random_like_rank, rank, size

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD


def _shared(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The same random tensor on every rank."""
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("hidden", ["even", "uneven"])
def test_split_two_layer_block_matches_a_single_process(hidden: str) -> None:
    """Megatron's MLP block: column-parallel W (copy_to_parallel before it), row-parallel V (reduce_from_parallel
    after it), a loss counted once. Gradients of X, of each rank's slice of W and V, equal the single-process ones."""
    width = 2 * size() + (1 if hidden == "uneven" else 0)
    x_full, w_full, v_full, c = _shared((5, 4), 1), _shared((4, width), 2), _shared((width, 3), 3), _shared((5, 3), 4)
    mine = torch.tensor_split(torch.arange(width), size())[rank()]

    x = x_full.t().clone().t().requires_grad_(True)  # non-contiguous, as activations often are
    w = w_full[:, mine].clone().requires_grad_(True)
    v = v_full[mine].clone().requires_grad_(True)
    z = ms.reduce_from_parallel(torch.tanh(ms.copy_to_parallel(x) @ w) @ v)
    (z * c).sum().backward()

    xr, wr, vr = (t.clone().requires_grad_(True) for t in (x_full, w_full, v_full))
    zr = torch.tanh(xr @ wr) @ vr
    (zr * c).sum().backward()

    torch.testing.assert_close(z.detach(), zr.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, wr.grad[:, mine], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(v.grad, vr.grad[mine], rtol=1e-12, atol=1e-12)


def test_copy_to_parallel_dot_product() -> None:
    """y = copy(x) for one shared x: sum_r <x, g_r> = <x, dL/dx> with dL/dx = sum_r g_r, counted once."""
    x = _shared((3, 2), 5).requires_grad_(True)
    g = random_like_rank((3, 2), seed=6)
    out = ms.copy_to_parallel(x)
    assert torch.equal(out.detach(), x.detach())
    out.backward(g)
    lhs = COMM.allreduce(float((x.detach() * g).sum()))
    rhs = float((x.detach() * x.grad).sum())
    assert math.isclose(lhs, rhs, rel_tol=1e-10, abs_tol=1e-12)
    torch.testing.assert_close(x.grad, torch.stack(gather_reference(g)).sum(0), rtol=1e-12, atol=1e-12)


def test_reduce_from_parallel_dot_product() -> None:
    """z = sum_r x_r, one shared value with one shared cotangent g: <z, g> = sum_r <x_r, dL/dx_r>, dL/dx_r = g."""
    x = random_like_rank((2, 3), seed=7).t().requires_grad_(True)
    g = _shared((3, 2), 8)
    z = ms.reduce_from_parallel(x)
    torch.testing.assert_close(z.detach(), torch.stack(gather_reference(x.detach())).sum(0), rtol=1e-12, atol=1e-12)
    z.backward(g)
    assert torch.equal(x.grad, g)
    lhs = float((z.detach() * g).sum())
    rhs = COMM.allreduce(float((x.detach() * x.grad).sum()))
    assert math.isclose(lhs, rhs, rel_tol=1e-10, abs_tol=1e-12)


def test_gradcheck_copy_then_reduce() -> None:
    """gradcheck runs on every rank at once (each perturbs its own element j, backward gets the same cotangent on
    every rank), valid when ``sum_s J_rs = sum_s J_sr``. ``reduce_from_parallel(copy_to_parallel(x) * w_r)`` gives
    every rank ``sum_s w_s x_s`` and its backward returns ``sum_s w_s g`` to each: the pair composes into a check."""
    x = random_like_rank((2, 2), seed=9).requires_grad_(True)
    weight = 1.0 + rank()
    assert torch.autograd.gradcheck(lambda t: ms.reduce_from_parallel(ms.copy_to_parallel(t) * weight), (x,))


def test_errors_raise_on_every_rank() -> None:
    with pytest.raises(TypeError, match="bool"):
        ms.copy_to_parallel(torch.ones(2, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        ms.reduce_from_parallel(torch.ones(2, dtype=torch.bool))
    if size() > 1:
        with pytest.raises(CommunicationError, match="disagree"):
            ms.reduce_from_parallel(torch.ones(1 + rank()))
    assert torch.equal(ms.reduce_from_parallel(torch.ones(2)), torch.full((2,), float(size())))
