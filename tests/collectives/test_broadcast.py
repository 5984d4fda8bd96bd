"""broadcast on 1-4 ranks (run under the MPI harness)."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import mpistrategy as ms
from mpistrategy import CommunicationError, Placeholder
from tests.adjoint import assert_adjoint, gather_reference, rank, size, strided

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
DTYPES = [torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.complex64]


def _roots() -> list[int]:
    return sorted({0, size() - 1})


@pytest.mark.parametrize("requires_grad", [False, True])
def test_broadcast_to_ranks_passing_none(requires_grad: bool) -> None:
    for root in _roots():
        x = strided((3, 2), seed=1).requires_grad_(requires_grad)
        out = ms.broadcast(x if rank() == root else None, root=root)
        expected = gather_reference(x)[root]
        assert torch.equal(out.detach(), expected) and out.dtype == torch.float64
        assert out.requires_grad == requires_grad  # shape, dtype and requires_grad travelled from the root


def test_broadcast_adjoint_with_none_on_non_roots() -> None:
    for root in _roots():

        def forward(t: torch.Tensor, root: int = root) -> torch.Tensor:
            return ms.broadcast(t if rank() == root else None, root=root)

        assert_adjoint(forward, strided((3, 2), seed=2), seed=2)


def test_broadcast_adjoint_with_tensors_on_non_roots() -> None:
    """Non-roots pass a tensor: it is linked into the graph, not read, and gets no gradient (torch's rule)."""
    root = size() - 1
    assert_adjoint(lambda t: ms.broadcast(t, root=root), strided((2, 4), seed=3), seed=3)
    x = strided((2, 4), seed=4).requires_grad_(True)
    ms.broadcast(x, root=root).sum().backward()
    if rank() != root:
        assert x.grad is None


def test_broadcast_backward_with_rank_weighted_loss() -> None:
    """Rank r's loss is (1 + r) * sum(y): the root's input gets sum_r (1 + r) = P (P + 1) / 2."""
    root = size() - 1
    x = strided((2, 2), seed=5).requires_grad_(True)
    out = ms.broadcast(x if rank() == root else None, root=root)
    (out * (1 + rank())).sum().backward()
    if rank() == root:
        assert torch.equal(x.grad, torch.full((2, 2), size() * (size() + 1) / 2, dtype=torch.float64))
    else:
        assert x.grad is None


def test_gradcheck_reduce_then_broadcast() -> None:
    """gradcheck runs on every rank at once (each perturbs its own element j, backward gets the same unit cotangent
    everywhere), which is valid when the Jacobian blocks satisfy ``sum_s J_rs = sum_s J_sr``. broadcast alone does
    not (only the root's input matters); ``broadcast(reduce(x))`` (every block I) does. gradcheck differentiates with
    ``torch.autograd.grad(..., inputs=t)``, which skips nodes not leading to ``t``: non-roots pass ``t`` to broadcast
    (linked, no gradient) so that its backward runs there too, and add their placeholder."""
    root = size() - 1
    x = strided((2, 2), seed=6).requires_grad_(True)

    def function(t: torch.Tensor) -> torch.Tensor:
        reduced = ms.reduce(t, root=root)
        if isinstance(reduced, Placeholder):
            return ms.broadcast(t, root=root) + reduced
        return ms.broadcast(reduced, root=root)

    assert torch.autograd.gradcheck(function, (x,))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_move_bit_exactly(dtype: torch.dtype) -> None:
    root = size() - 1
    x = strided((3, 2), seed=7, dtype=dtype)
    out = ms.broadcast(x if rank() == root else None, root=root)
    expected = gather_reference(x)[root]
    assert out.dtype == dtype and out.shape == (3, 2)
    if dtype in (torch.float16, torch.bfloat16):
        out, expected = out.view(torch.int16), expected.contiguous().view(torch.int16)
    assert torch.equal(out, expected)


def test_receivers_get_a_new_tensor_and_the_root_its_own_memory() -> None:
    x = torch.arange(3.0)
    out = ms.broadcast(x if rank() == 0 else None, root=0, device="cpu")
    assert torch.equal(out, torch.arange(3.0)) and out.device.type == "cpu"
    assert (out.data_ptr() == x.data_ptr()) == (rank() == 0)  # no copy on the root
    strided_root = torch.arange(6.0).reshape(2, 3).t()
    copied = ms.broadcast(strided_root if rank() == 0 else None, root=0)
    assert copied.is_contiguous() and torch.equal(copied, torch.arange(6.0).reshape(2, 3).t())


def test_root_errors_raise_on_every_rank() -> None:
    """The root raises its own error, the other ranks a CommunicationError that names the root and the error."""
    root = size() - 1
    at_root = rank() == root
    with pytest.raises(ValueError if at_root else CommunicationError, match=f"rank {root} passed no tensor"):
        ms.broadcast(None, root=root)
    with pytest.raises(ValueError, match="root"):
        ms.broadcast(torch.ones(2), root=size())
    with pytest.raises(ValueError, match="root"):
        ms.broadcast(torch.ones(2), root=-1)
    with pytest.raises(TypeError if at_root else CommunicationError, match="cannot be communicated"):
        ms.broadcast(torch.ones(2, dtype=torch.uint16) if at_root else None, root=root)
    out = ms.broadcast(torch.ones(2) if at_root else None, root=root)
    assert torch.equal(out, torch.ones(2))  # every rank still in step


def test_ranks_passing_different_roots_raise_on_every_rank() -> None:
    """No rank broadcasts: the rank that believed it was the root keeps its own input unchanged."""
    if size() == 1:
        pytest.skip("one rank cannot disagree with itself")
    mine = torch.full((2,), float(rank()))
    disagreement = (
        r"broadcast: ranks disagree on the root \(rank 0: broadcast\(root=0\) at \S+:\d+; "
        r"rank 1: broadcast\(root=1\) at \S+:\d+"
    )
    with pytest.raises(CommunicationError, match=disagreement):
        ms.broadcast(mine, root=min(rank(), 1))
    assert torch.equal(mine, torch.full((2,), float(rank())))
    assert torch.equal(ms.broadcast(mine, root=1), torch.ones(2))


def test_without_validation_the_root_still_reports_its_own_errors() -> None:
    """Validation off: the header the root broadcasts anyway carries a flag when its checks failed."""
    root = size() - 1
    with ms.validation(False):
        at_root = rank() == root
        with pytest.raises(ValueError if at_root else CommunicationError, match="meta" if at_root else f"rank {root}"):
            ms.broadcast(torch.ones(2, device="meta") if rank() == root else None, root=root)
        out = ms.broadcast(torch.arange(3.0) if rank() == root else None, root=root)
    assert torch.equal(out, torch.arange(3.0))
