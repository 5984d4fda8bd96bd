"""gather, gather_v, scatter, scatter_v, allgather, allgather_v on 1-4 ranks (run under the MPI harness)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpistrategy as ms
from mpistrategy import CommunicationError, Placeholder
from tests.adjoint import assert_adjoint, gather_reference, rank, shape_along, size, strided

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
ROWS = {"r+1": lambda r: r + 1, "r (rank 0 empty)": lambda r: r}
DTYPES = [torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.complex64]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """A view that compares bit patterns (so that -0.0, NaN and half precision compare exactly)."""
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return tensor.contiguous().view(torch.int16)
    return tensor


def _assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(_bits(actual), _bits(expected))


def _split_reference(full: torch.Tensor, sizes: list[int], dim: int) -> list[torch.Tensor]:
    return list(torch.split(full, sizes, dim=dim))


# ---------------------------------------------------------------------------------------------------------------
# gather / gather_v


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("where", ["first", "last"])
def test_gather_forward_matches_reference(dim: int, where: str) -> None:
    root = 0 if where == "first" else size() - 1
    x = strided(shape_along(dim % 2, 2), seed=1)
    assert not x.is_contiguous()
    out = ms.gather(x, root=root, dim=dim)
    expected = torch.cat(gather_reference(x), dim=dim)
    if rank() == root:
        _assert_bit_equal(out, expected)
    else:
        assert isinstance(out, Placeholder)
        assert out.holder == root and out.shape == expected.shape and out.dtype == expected.dtype


@pytest.mark.parametrize("dim", [0, 1])
def test_gather_adjoint(dim: int) -> None:
    root = size() - 1
    assert_adjoint(lambda t: ms.gather(t, root=root, dim=dim), strided(shape_along(dim, 2), seed=2), seed=2)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("given", [False, True], ids=["learned", "given"])
def test_gather_v_forward_and_adjoint(rows: str, dim: int, given: bool) -> None:
    root = size() - 1
    lengths = [ROWS[rows](r) for r in range(size())]
    sizes = lengths if given else None
    x = strided(shape_along(dim, lengths[rank()]), seed=3)
    out = ms.gather_v(x, root=root, dim=dim, sizes=sizes)
    expected = torch.cat(gather_reference(x), dim=dim)
    if rank() == root:
        _assert_bit_equal(out, expected)
    else:
        assert isinstance(out, Placeholder) and out.shape == expected.shape
    assert_adjoint(lambda t: ms.gather_v(t, root=root, dim=dim, sizes=sizes), x, seed=3)


def test_gather_placeholder_takes_part_in_backward_through_the_loss() -> None:
    """Non-roots add the placeholder to their loss; rank r's input gets block r of the root's cotangent."""
    root = size() - 1
    x = strided((2, 3), seed=4).requires_grad_(True)
    weight = torch.arange(2.0 * 3 * size(), dtype=torch.float64).reshape(2 * size(), 3)
    out = ms.gather(x, root=root)
    loss = (out * weight).sum() if rank() == root else torch.zeros((), dtype=torch.float64) + out
    loss.backward()
    assert torch.equal(x.grad, weight[2 * rank() : 2 * rank() + 2])


def test_gather_without_grad_and_integer_dtypes_need_no_backward() -> None:
    x = torch.arange(4, dtype=torch.int64).reshape(2, 2) + 10 * rank()
    out = ms.gather(x, root=0)
    if rank() != 0:
        assert not out.requires_grad
        out.backward()  # a no-op: nothing to take part in
    with torch.no_grad():
        y = ms.gather(torch.ones(2, requires_grad=True), root=0)
    assert not y.requires_grad


# ---------------------------------------------------------------------------------------------------------------
# scatter / scatter_v


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter_forward_matches_reference(dim: int) -> None:
    root = size() - 1
    full = strided(shape_along(dim % 2, 2 * size()), seed=5).requires_grad_(True)
    out = ms.scatter(full if rank() == root else None, root=root, dim=dim)
    expected = torch.chunk(gather_reference(full)[root], size(), dim=dim)[rank()]
    _assert_bit_equal(out.detach(), expected)
    assert out.requires_grad  # requires_grad travelled from the root


@pytest.mark.parametrize("dim", [0, 1])
def test_scatter_adjoint(dim: int) -> None:
    root = size() - 1

    def forward(t: torch.Tensor) -> torch.Tensor:
        return ms.scatter(t if rank() == root else None, root=root, dim=dim)

    assert_adjoint(forward, strided(shape_along(dim, 2 * size()), seed=6), seed=6)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("pattern", ["r (rank 0 empty)", "default split"])
def test_scatter_v_forward_and_adjoint(dim: int, pattern: str) -> None:
    root = size() - 1
    if pattern == "default split":
        length, sizes = 2 * size() + 1, None
        expected_sizes = [t.shape[0] for t in torch.tensor_split(torch.empty(length), size())]
    else:
        expected_sizes = [r for r in range(size())]
        length, sizes = sum(expected_sizes), expected_sizes
    full = strided(shape_along(dim, length), seed=7)

    def forward(t: torch.Tensor) -> torch.Tensor:
        # Only the root's sizes are read: the others pass nonsense to show it.
        return ms.scatter_v(t if rank() == root else None, root=root, dim=dim, sizes=sizes if rank() == root else [-1])

    out = forward(full)
    expected = _split_reference(gather_reference(full)[root], expected_sizes, dim)[rank()]
    _assert_bit_equal(out, expected)
    assert_adjoint(forward, full, seed=7)


def test_scatter_backward_gathers_to_the_root_only() -> None:
    root = size() - 1
    full = strided((2 * size(), 3), seed=8).requires_grad_(True)
    mine = torch.zeros(5, requires_grad=True)  # a non-root tensor: linked, not read, gets no gradient
    out = ms.scatter(full if rank() == root else mine, root=root)
    (out * (1 + rank())).sum().backward()
    if rank() == root:
        expected = torch.repeat_interleave(torch.arange(1.0, size() + 1, dtype=torch.float64), 2)
        assert torch.equal(full.grad, expected[:, None].expand(-1, 3))
    else:
        assert full.grad is None and mine.grad is None


def test_scatter_under_no_grad_on_the_root_needs_no_backward() -> None:
    full = torch.ones(size(), 2, requires_grad=True)
    with torch.no_grad():
        out = ms.scatter(full if rank() == 0 else None, root=0)
    assert not out.requires_grad


# ---------------------------------------------------------------------------------------------------------------
# allgather / allgather_v


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_allgather_forward_and_adjoint(dim: int) -> None:
    x = strided(shape_along(dim % 2, 2), seed=9)
    out = ms.allgather(x, dim=dim)
    _assert_bit_equal(out, torch.cat(gather_reference(x), dim=dim))
    assert_adjoint(lambda t: ms.allgather(t, dim=dim), x, seed=9)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("given", [False, True], ids=["learned", "given"])
def test_allgather_v_forward_and_adjoint(rows: str, dim: int, given: bool) -> None:
    lengths = [ROWS[rows](r) for r in range(size())]
    sizes = lengths if given else None
    x = strided(shape_along(dim, lengths[rank()]), seed=10)
    out = ms.allgather_v(x, dim=dim, sizes=sizes)
    _assert_bit_equal(out, torch.cat(gather_reference(x), dim=dim))
    assert_adjoint(lambda t: ms.allgather_v(t, dim=dim, sizes=sizes), x, seed=10)


def test_allgather_backward_with_rank_weighted_loss() -> None:
    """Every rank's loss weighs the whole gathered tensor by 1 + rank: each input gets the sum of the weights."""
    x = strided((2, 3), seed=11).requires_grad_(True)
    (ms.allgather(x) * (1 + rank())).sum().backward()
    assert torch.equal(x.grad, torch.full((2, 3), size() * (size() + 1) / 2, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------------------
# gradcheck. Every rank runs gradcheck at once, perturbing its own input element j while the others perturb theirs,
# and seeds backward with the same unit cotangent on every rank. The numerical and analytical Jacobians then agree
# only for functions whose output on rank r depends on the inputs of rank r alone ("rank-local"); the compositions
# below are rank-local but send every value through the other ranks. Inputs have the same number of elements on
# every rank, so every rank makes the same number of calls (uneven v-variants would deadlock, so they are left out).


@pytest.mark.parametrize("dim", [0, 1])
def test_gradcheck_allgather_then_reduce_scatter(dim: int) -> None:
    """``reduce_scatter(allgather(x) * w_r)`` gives rank r ``x_r * sum_s w_s[block r]``."""
    x = strided(shape_along(dim, 2), seed=12).requires_grad_(True)
    weight = 1 + rank() + torch.arange(2.0 * size() * 3, dtype=torch.float64).reshape(shape_along(dim, 2 * size()))

    def function(t: torch.Tensor) -> torch.Tensor:
        return ms.reduce_scatter(ms.allgather(t, dim=dim) * weight, dim=dim)

    assert torch.autograd.gradcheck(function, (x,))


@pytest.mark.parametrize("dim", [0, 1])
def test_gradcheck_gather_then_scatter(dim: int) -> None:
    """``scatter(gather(x) * w)`` gives rank r ``x_r * w[block r]``; non-roots link their placeholder.

    gradcheck differentiates with ``torch.autograd.grad(..., inputs=x)``, which skips graph nodes that do not lead to
    ``x``: a non-root's scatter node leads only to its anchor, so non-roots pass ``t`` to scatter to keep it there.
    """
    root = size() - 1
    x = strided(shape_along(dim, 2), seed=13).requires_grad_(True)
    weight = torch.arange(1.0, 1 + 2 * size() * 3, dtype=torch.float64).reshape(shape_along(dim, 2 * size()))

    def function(t: torch.Tensor) -> torch.Tensor:
        gathered = ms.gather(t, root=root, dim=dim)
        if isinstance(gathered, Placeholder):
            return ms.scatter(t, root=root, dim=dim) + gathered
        return ms.scatter(gathered * weight, root=root, dim=dim)

    assert torch.autograd.gradcheck(function, (x,))


# ---------------------------------------------------------------------------------------------------------------
# dtypes: data moves bit for bit


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_move_bit_exactly(dtype: torch.dtype) -> None:
    root = size() - 1
    x = strided((3, 2), seed=14, dtype=dtype)
    everyone = gather_reference(x)
    gathered = ms.gather(x, root=root, dim=1)
    if rank() == root:
        _assert_bit_equal(gathered, torch.cat(everyone, dim=1))
    _assert_bit_equal(ms.allgather(x, dim=1), torch.cat(everyone, dim=1))
    _assert_bit_equal(ms.allgather_v(x[: rank() % 2 + 1]), torch.cat([t[: r % 2 + 1] for r, t in enumerate(everyone)]))
    full = strided((size(), 3), seed=15, dtype=dtype)
    root_full = gather_reference(full)[root]
    _assert_bit_equal(ms.scatter(full if rank() == root else None, root=root), root_full[rank() : rank() + 1])
    part = ms.scatter_v(full if rank() == root else None, root=root, dim=1, sizes=[3] + [0] * (size() - 1))
    _assert_bit_equal(part, root_full if rank() == 0 else root_full[:, :0])


# ---------------------------------------------------------------------------------------------------------------
# errors: every rank raises, none is left waiting


def test_root_out_of_range_raises_value_error_on_every_rank() -> None:
    x = torch.ones(2)
    for bad in (size(), -1):
        with pytest.raises(ValueError, match="root"):
            ms.gather(x, root=bad)
        with pytest.raises(ValueError, match="root"):
            ms.gather_v(x, root=bad)
        with pytest.raises(ValueError, match="root"):
            ms.scatter(x if rank() == 0 else None, root=bad)
        with pytest.raises(ValueError, match="root"):
            ms.scatter_v(x if rank() == 0 else None, root=bad)
    assert torch.equal(ms.allgather(x), torch.ones(2 * size()))  # every rank still in step


def test_mismatched_shapes_raise_communication_error_on_every_rank() -> None:
    if size() == 1:
        pytest.skip("one rank cannot disagree with itself")
    x = torch.ones(2, 2 + rank())
    with pytest.raises(CommunicationError, match="disagree"):
        ms.allgather(x)
    with pytest.raises(CommunicationError, match="disagree"):
        ms.gather(x, root=0)
    with pytest.raises(CommunicationError, match="disagree"):
        ms.allgather_v(x, dim=0)  # uneven along dim 1 but gathered along dim 0
    with pytest.raises(CommunicationError, match="disagree"):
        ms.allgather(torch.ones(2, dtype=torch.float32 if rank() else torch.float64))
    with pytest.raises(CommunicationError, match="requires_grad"):
        ms.allgather(torch.ones(2, requires_grad=rank() == 0))
    assert torch.equal(ms.allgather_v(x, dim=1), torch.ones(2, sum(2 + r for r in range(size()))))


def test_scatter_with_root_passing_none_raises_on_every_rank() -> None:
    root = size() - 1
    expected = ValueError if rank() == root else CommunicationError
    with pytest.raises(expected, match=f"rank {root} passed no tensor"):
        ms.scatter(None, root=root)
    with pytest.raises(expected, match=f"rank {root} passed no tensor"):
        ms.scatter_v(None, root=root)


def test_bad_scatter_arguments_raise_on_every_rank() -> None:
    """The root checks its tensor, dim and sizes before sending the header: the other ranks learn its error."""
    full = torch.ones(2 * size() + 1, 2)
    expected = ValueError if rank() == 0 else CommunicationError
    if size() > 1:
        with pytest.raises(expected, match="not divisible"):
            ms.scatter(full if rank() == 0 else None, root=0)
    with pytest.raises(expected, match="sizes"):
        ms.scatter_v(full if rank() == 0 else None, root=0, sizes=[1] * size())
    with pytest.raises(expected, match="out of range"):
        ms.scatter(full if rank() == 0 else None, root=0, dim=2)
    assert torch.equal(ms.scatter(torch.ones(size(), 2) if rank() == 0 else None, root=0), torch.ones(1, 2))


def test_bad_local_arguments_raise_on_every_rank() -> None:
    x = torch.ones(1 + rank(), 2)
    bad_sizes = [1 + r for r in range(size())]
    bad_sizes[-1] += 1  # wrong on the last rank only
    with pytest.raises((ValueError, CommunicationError), match="sizes"):
        ms.gather_v(x, root=0, sizes=bad_sizes)
    with pytest.raises((TypeError, CommunicationError)):
        ms.allgather_v(x if rank() != size() - 1 else None)
    with pytest.raises(ValueError, match="at least one dimension"):
        ms.allgather(torch.tensor(1.0))
    with pytest.raises(TypeError, match="cannot be communicated"):
        ms.allgather(torch.ones(2, dtype=torch.uint16))


def test_without_validation_the_size_exchange_still_reports_bad_arguments() -> None:
    x = torch.ones(1 + rank(), 2)
    ms.set_validation(False)
    try:
        with pytest.raises((ValueError, CommunicationError)):
            ms.allgather_v(x, dim=5 if rank() == 0 else 0)
        with pytest.raises((TypeError, CommunicationError)):
            ms.gather_v(x if rank() != size() - 1 else "not a tensor", root=0)
    finally:
        ms.set_validation(True)
    assert ms.allgather_v(x).shape == (sum(1 + r for r in range(size())), 2)


def test_placeholder_names_the_root_and_refuses_tensor_ops() -> None:
    if size() == 1:
        pytest.skip("one rank is always the root")
    root = size() - 1
    out = ms.gather(torch.ones(2, 3), root=root, dim=1)
    if rank() == root:
        return
    assert isinstance(out, Placeholder)
    assert f"rank {root}" in repr(out) and "'gather'" in repr(out) and f"shape=(2, {3 * size()})" in repr(out)
    with pytest.raises(TypeError, match=f"held by rank {root}"):
        torch.sin(out)
    with pytest.raises(TypeError, match=f"held by rank {root}"):
        torch.cat([torch.ones(2, 3), out])
    operators = {
        "multiplied": lambda: torch.ones(2, 3) * out,
        "subtracted": lambda: out - 1,
        "indexed": lambda: out[0],
        "converted": lambda: float(out),
        "tested for truth": lambda: bool(out),
    }
    for what, use in operators.items():
        with pytest.raises(TypeError, match=f"held by rank {root}"):
            use()
            pytest.fail(f"a placeholder {what}")
    for method in ("sum", "item", "numpy", "to"):
        with pytest.raises(AttributeError, match=f"no .{method}: gather's result is not on this rank"):
            getattr(out, method)


@pytest.mark.parametrize("name", ["allgather", "allgather_v", "gather", "gather_v", "alltoall", "alltoall_v"])
def test_ranks_may_spell_the_same_dim_differently(name: str) -> None:
    """``dim=-1`` on some ranks and ``dim=1`` on others name the same dimension of a 2-D tensor: one call."""
    x = torch.arange(2.0 * 2 * size()).reshape(2, 2 * size()) + 100 * rank()
    ops = {
        "allgather": lambda d: ms.allgather(x, dim=d),
        "allgather_v": lambda d: ms.allgather_v(x, dim=d),
        "gather": lambda d: ms.gather(x, root=0, dim=d),
        "gather_v": lambda d: ms.gather_v(x, root=0, dim=d),
        "alltoall": lambda d: ms.alltoall(x, dim=d),
        "alltoall_v": lambda d: ms.alltoall_v(x, [2] * size(), dim=d),
    }
    spelled = ops[name](-1 if rank() % 2 else 1)
    expected = ops[name](1)
    if isinstance(expected, torch.Tensor):
        assert torch.equal(spelled, expected)


def test_numpy_integers_name_roots_dims_and_peers() -> None:
    """Roots, dims, peers and tags given as NumPy integers, as mpi4py and torch.distributed take them."""
    root, dim = np.int64(size() - 1), np.int32(0)
    x = torch.full((size(), 2), float(rank()))
    assert torch.equal(ms.broadcast(x, root=root), torch.full((size(), 2), float(size() - 1)))
    everyone = ms.allgather(x, dim=0)
    assert torch.equal(ms.allgather(x, dim=dim), everyone)
    gathered = ms.gather(x, root=root, dim=dim)
    if rank() == size() - 1:
        assert torch.equal(gathered, everyone)
    assert torch.equal(ms.scatter(x, root=np.int16(0), dim=dim), torch.zeros(1, 2))
    reduced = ms.reduce(x, root=root)
    if rank() == size() - 1:
        assert torch.equal(reduced, torch.full((size(), 2), float(sum(range(size())))))
    peer = ms.sendrecv(x, dst=np.int64((rank() + 1) % size()), src=np.int64((rank() - 1) % size()), tag=np.int8(3))
    assert torch.equal(peer, torch.full((size(), 2), float((rank() - 1) % size())))
    with pytest.raises(ValueError, match="root=True is not a rank"):
        ms.broadcast(x, root=True)
    assert torch.equal(ms.reduce_scatter(x, dim=dim), ms.reduce_scatter(x, dim=0))
    for op in (ms.allgather, ms.reduce_scatter, ms.alltoall):
        for bad in (True, 1.0):
            with pytest.raises(TypeError, match=f"dim must be an int, got {bad!r}"):
                op(x, dim=bad)
