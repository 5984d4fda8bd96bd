"""allreduce, iallreduce, reduce, reduce_scatter and reduce_scatter_v on 1-4 ranks (run under the MPI harness)."""

from __future__ import annotations

import functools
import math
import struct
import threading

import pytest
import torch
from mpi4py import MPI
from torch.profiler import ProfilerActivity

import mpistrategy as ms
from mpistrategy import CommunicationError, Placeholder
from mpistrategy.collectives import handles
from mpistrategy.comm.checks import agree
from tests.adjoint import assert_adjoint, gather_reference, random_like_rank, rank, rank_generator, size, strided

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD


def _stacked(local: torch.Tensor) -> torch.Tensor:
    """Every rank's ``local``, stacked along a new first dimension (the single-process reference input)."""
    return torch.stack(gather_reference(local))


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# allreduce


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_allreduce_sum_avg_forward_and_adjoint(op: str) -> None:
    x = strided((3, 2), seed=1)
    out = ms.allreduce(x, op)
    expected = _stacked(x).sum(0) / (size() if op == "avg" else 1)
    _assert_close(out, expected)
    assert_adjoint(lambda t: ms.allreduce(t, op), x, seed=1)


def _ties(seed: int) -> torch.Tensor:
    """Small integers as float64, so that several ranks often hold the same extremum; [0, 0] ties on all ranks."""
    x = torch.randint(0, 3, (4, 3), generator=torch.Generator().manual_seed(100 * seed + rank())).double()
    x[0, 0] = 7.0
    x[0, 1] = -7.0
    return x


@pytest.mark.parametrize("op", ["max", "min"])
def test_allreduce_max_min_gradient_goes_to_the_lowest_owner(op: str) -> None:
    x = _ties(seed=2).requires_grad_(True)
    y = random_like_rank((4, 3), seed=3)
    out = ms.allreduce(x, op)
    out.backward(y)
    inputs, cotangents = _stacked(x.detach()), _stacked(y)
    extreme = inputs.amax(0) if op == "max" else inputs.amin(0)
    assert torch.equal(out.detach(), extreme)
    owner = (inputs == extreme).int().argmax(0)  # the first (lowest) rank holding the extremum
    expected = torch.where(owner == rank(), cotangents.sum(0), torch.zeros(4, 3, dtype=torch.float64))
    _assert_close(x.grad, expected)  # includes [0, 0] and [0, 1], tied on every rank: rank 0 owns them


@pytest.mark.parametrize("op", ["max", "min"])
def test_allreduce_max_min_adjoint(op: str) -> None:
    """max and min are positively homogeneous, so the dot-product identity holds for them too."""
    assert_adjoint(lambda t: ms.allreduce(t, op), _ties(seed=4), seed=4)


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_allreduce_gradcheck(op: str) -> None:
    """gradcheck runs on every rank at once: each rank perturbs its own element j while the others perturb theirs,
    and seeds backward with the same cotangent everywhere. That is valid when the Jacobian blocks satisfy
    ``sum_s J_rs = sum_s J_sr``, as for sum and avg (every block is I or I/P); not for max/min (left to the
    reference test above)."""
    x = strided((2, 2), seed=5).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: ms.allreduce(t, op), (x,))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_sums_are_exact(dtype: torch.dtype) -> None:
    """1.5 and 2.25 are exact in both formats, and so are their sums over up to 4 ranks: summing bit patterns or
    rounding after every step would show."""
    value = 1.5 if rank() % 2 == 0 else 2.25
    x = torch.full((3,), value, dtype=dtype)
    total = sum(1.5 if r % 2 == 0 else 2.25 for r in range(size()))
    out = ms.allreduce(x)
    assert out.dtype == dtype and torch.equal(out, torch.full((3,), total, dtype=dtype))
    assert torch.equal(ms.allreduce(x, "avg"), torch.full((3,), total / size(), dtype=torch.float64).to(dtype))
    assert torch.equal(ms.allreduce(x, "max"), torch.full((3,), 2.25 if size() > 1 else 1.5, dtype=dtype))
    product = math.prod(1.5 if r % 2 == 0 else 2.25 for r in range(size()))  # 729/64 at 4 ranks: 10 bits
    assert torch.equal(ms.allreduce(x, "prod"), torch.full((3,), product, dtype=torch.float64).to(dtype))


def test_bool_max_min_are_logical_or_and() -> None:
    x = random_like_rank((5, 2), seed=6) > 0
    everyone = _stacked(x)
    assert torch.equal(ms.allreduce(x, "max"), everyone.any(0))
    assert torch.equal(ms.allreduce(x, "min"), everyone.all(0))


def test_integer_sums_are_exact() -> None:
    x = torch.arange(4, dtype=torch.int64) * (2**40) + rank()
    assert torch.equal(ms.allreduce(x), _stacked(x).sum(0))
    assert torch.equal(ms.allreduce(x, "min"), _stacked(x).amin(0))


def test_dtype_and_op_errors_raise_on_every_rank() -> None:
    with pytest.raises(TypeError, match="avg"):
        ms.allreduce(torch.ones(2, dtype=torch.int64), "avg")
    with pytest.raises(TypeError, match="bool"):
        ms.allreduce(torch.ones(2, dtype=torch.bool), "sum")
    with pytest.raises(TypeError, match="complex"):
        ms.allreduce(torch.ones(2, dtype=torch.complex64), "max")
    with pytest.raises(ValueError, match="unknown reduction op 'mul'; choose one of .*'prod'"):
        ms.allreduce(torch.ones(2), "mul")
    with pytest.raises(TypeError, match="avg"):
        ms.reduce(torch.ones(2, dtype=torch.int32), op="avg")
    with pytest.raises(TypeError, match="op='band' is a bitwise op.*got torch.float32; cast the tensor to an integer"):
        ms.allreduce(torch.ones(2), "band")
    with pytest.raises(TypeError, match=r"op='lor' is a logical op.*got torch.float64; pass a bool tensor"):
        ms.reduce_scatter(torch.ones(size(), dtype=torch.float64), op="lor")
    with pytest.raises(TypeError, match="op='prod' is not defined for torch.bool; use op='lor'.*'land'"):
        ms.iallreduce(torch.ones(2, dtype=torch.bool), "prod")
    with pytest.raises(TypeError, match="op='bxor' is a bitwise op.*complex64"):
        ms.reduce(torch.ones(2, dtype=torch.complex64), op="bxor")


def test_a_reduce_scatter_disagreement_names_each_ranks_sizes_and_requires_grad() -> None:
    """The error shows the arguments as each rank gave them: ``sizes`` (and ``requires_grad`` where set)."""
    if size() == 1:
        pytest.skip("one rank cannot disagree with itself")
    length = size() - 1
    first, last = [length] + [0] * length, [0] * length + [length]  # rank 0's blocks, the others'
    with pytest.raises(CommunicationError) as refused:
        ms.reduce_scatter_v(torch.ones(length), sizes=first if rank() == 0 else last)
    for who, blocks in ((0, first), (1, last)):
        call = f"rank {who}: reduce_scatter_v(float32[{length}], op=sum, dim=0, sizes={', '.join(map(str, blocks))})"
        assert call in str(refused.value), str(refused.value)
    with pytest.raises(CommunicationError) as refused:
        ms.reduce_scatter(torch.ones(size(), requires_grad=rank() == 0))
    blocks = ", ".join(["1"] * size())
    assert f"rank 0: reduce_scatter(float32[{size()}], op=sum, requires_grad=1, dim=0, sizes={blocks}) at" in str(
        refused.value
    )
    assert f"rank 1: reduce_scatter(float32[{size()}], op=sum, dim=0, sizes={blocks}) at" in str(refused.value)


def test_mismatched_shapes_raise_communication_error_on_every_rank() -> None:
    if size() == 1:
        pytest.skip("one rank cannot disagree with itself")
    with pytest.raises(CommunicationError, match="disagree"):
        ms.allreduce(torch.ones(1 + rank()))
    with pytest.raises(CommunicationError, match="disagree"):
        ms.allreduce(torch.ones(2), "sum" if rank() else "avg")
    with pytest.raises(CommunicationError, match="disagree"):
        ms.reduce(torch.ones(2), root=rank())
    assert torch.equal(ms.allreduce(torch.ones(2)), torch.full((2,), float(size())))


def test_agree_on_long_signatures_names_every_ranks_values() -> None:
    agree(ms.world(), "test", list(range(100)))
    if size() > 1:
        with pytest.raises(CommunicationError, match=r"rank 0: test\(.*98, 0\) at \S+:\d+; rank 1: test\(.*98, 1\)"):
            agree(ms.world(), "test", [*range(99), rank()])
        with pytest.raises(CommunicationError, match="disagree"):  # -1 and -2 hash alike in Python: not here
            agree(ms.world(), "test", [-1 - rank() % 2])


def test_validation_block_is_scoped_to_its_thread() -> None:
    seen: list[bool] = []
    with ms.validation(False):
        assert not ms.validation_enabled()
        worker = threading.Thread(target=lambda: seen.append(ms.validation_enabled()))
        worker.start()
        worker.join()
    assert ms.validation_enabled() and seen == [True]
    if size() > 1:
        with pytest.raises(CommunicationError, match="disagree"):
            ms.allreduce(torch.ones(1 + rank()))


# ---------------------------------------------------------------------------------------------------------------
# iallreduce


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_iallreduce_forward_and_backward(op: str) -> None:
    x = strided((3, 2), seed=7).requires_grad_(True)
    y = random_like_rank((3, 2), seed=8)
    handle = ms.iallreduce(x, op)
    out = handle.wait()
    assert handle.test() and handle.is_completed() and handle.wait() is out
    scale = size() if op == "avg" else 1
    _assert_close(out, _stacked(x.detach()).sum(0) / scale)
    (out * y).sum().backward()
    _assert_close(x.grad, _stacked(y).sum(0) / scale)
    assert_adjoint(lambda t: ms.iallreduce(t, op).wait(), x, seed=9)


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "separate out"])
def test_iallreduce_out_under_no_grad(op: str, layout: str) -> None:
    x = strided((3, 2), seed=10)
    if layout == "contiguous":
        x = x.contiguous()
    expected = _stacked(x).sum(0) / (size() if op == "avg" else 1)
    out = torch.empty(3, 2, dtype=torch.float64) if layout == "separate out" else x
    pointer = out.data_ptr()
    with torch.no_grad():
        result = ms.iallreduce(x, op, out=out).wait()
    assert result is out and out.data_ptr() == pointer
    _assert_close(out, expected)


def test_iallreduce_in_place_allocates_no_result_buffer() -> None:
    x = torch.full((1 << 16,), float(rank() + 1), dtype=torch.float64)
    nbytes = x.numel() * x.element_size()
    with torch.no_grad(), torch.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        ms.iallreduce(x, "avg", out=x).wait()
    allocated = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert max(allocated, default=0) < nbytes, f"an in-place allreduce allocated {max(allocated)} bytes"
    _assert_close(x, torch.full_like(x, (size() + 1) / 2))


@pytest.mark.parametrize("op", ["sum", "avg", "prod"])
@pytest.mark.parametrize("recorded", [False, True], ids=["no grad", "recorded"])
def test_a_dropped_iallreduce_handle_keeps_its_buffers_until_mpi_is_done(op: str, recorded: bool) -> None:
    """Handles dropped before wait(): MPI still writes their results; freed, that memory would be handed to the
    next tensors, which then hold the dropped allreduces' values (or the heap breaks)."""
    n = 1 << 17
    for round_ in range(8):
        x = torch.full((n,), float(rank() + 1), dtype=torch.float64, requires_grad=recorded)
        handle = ms.iallreduce(x, op)
        del handle, x
        later = [torch.full((n,), -1.0, dtype=torch.float64) for _ in range(4)]
        total = ms.allreduce(torch.full((n,), float(round_), dtype=torch.float64))
        assert torch.all(total == round_ * size()), "a dropped handle's allreduce wrote into a later tensor"
        assert all(torch.all(t == -1.0) for t in later), "a dropped handle's allreduce wrote into a later tensor"
    ms.iallreduce(torch.ones(1, dtype=torch.float64)).wait()
    COMM.Barrier()
    ms.iallreduce(torch.ones(1, dtype=torch.float64)).wait()
    assert not handles._parked, "completed requests of dropped handles are still held"


@pytest.mark.parametrize("orders", ["same", "per rank"])
def test_iallreduce_handles_waited_in_another_order_on_some_ranks_raise_in_backward(orders: str) -> None:
    """Backward follows the order of the waits: the same order everywhere (here the reverse of the posts) gives
    every gradient; another order on odd ranks raises on every rank, naming the waits."""
    xs = [random_like_rank((4,), seed=20 + k, dtype=torch.float64).requires_grad_(True) for k in range(3)]
    handles_ = [ms.iallreduce(x, op) for x, op in zip(xs, ["sum", "avg", "prod"], strict=True)]
    order = [1, 2, 0] if orders == "per rank" and rank() % 2 else [2, 1, 0]
    results = {k: handles_[k].wait() for k in order}
    loss = sum((k + 1) * results[k].sum() for k in range(3))
    if orders == "per rank" and size() > 1:
        with pytest.raises(CommunicationError, match="backward follows the order of the waits"):
            loss.backward()
        return
    loss.backward()
    everyone = _stacked(torch.stack([x.detach() for x in xs]))  # [rank, k, element]
    others = everyone[:, 2].prod(0) / xs[2].detach()
    torch.testing.assert_close(xs[0].grad, torch.full((4,), float(size()), dtype=torch.float64))
    torch.testing.assert_close(xs[1].grad, torch.full((4,), 2.0, dtype=torch.float64))
    torch.testing.assert_close(xs[2].grad, 3.0 * size() * others)


def test_iallreduce_errors_raise_on_every_rank() -> None:
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match="no_grad"):
        ms.iallreduce(x, out=x)
    with pytest.raises(ValueError, match="non-blocking"):
        ms.iallreduce(x, "max")


# ---------------------------------------------------------------------------------------------------------------
# reduce


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_reduce_to_a_non_zero_root(op: str) -> None:
    root = size() - 1
    x = strided((2, 3), seed=11)
    out = ms.reduce(x, root=root, op=op)
    expected = _stacked(x).sum(0) / (size() if op == "avg" else 1)
    if rank() == root:
        _assert_close(out, expected)
    else:
        assert isinstance(out, Placeholder) and out.holder == root and out.shape == (2, 3)
        assert f"rank {root}" in repr(out)
        with pytest.raises(TypeError, match=f"held by rank {root}"):
            torch.exp(out)
    assert_adjoint(lambda t: ms.reduce(t, root=root, op=op), x, seed=11)


def test_one_backward_line_for_every_rank_takes_tensor_backwards_arguments() -> None:
    """``out.backward(...)`` written once for the root's tensor and the others' Placeholder: ``retain_graph`` lets
    it run twice (the gradient doubles), ``inputs`` limits what accumulates, and ``create_graph`` is refused on every
    rank (reduce has no second derivative) with the ranks still in step."""
    x = strided((2, 3), seed=12).requires_grad_(True)
    w = random_like_rank((2, 3), seed=13).requires_grad_(True)
    out = ms.reduce(x * w, root=0)
    loss = out.sum() if rank() == 0 else out
    for _ in range(2):
        loss.backward(retain_graph=True)
    assert torch.equal(x.grad, 2 * w.detach()) and torch.equal(w.grad, 2 * x.detach())
    x.grad, w.grad = None, None
    loss.backward(inputs=[x])
    assert torch.equal(x.grad, w.detach()) and w.grad is None
    out = ms.reduce(x * w, root=0)
    loss = out.sum() ** 2 if rank() == 0 else out
    with pytest.raises(RuntimeError, match="^reduce: its gradient cannot be differentiated again"):
        loss.backward(create_graph=True)
    assert COMM.allreduce(1) == size()


def test_reduce_root_out_of_range_raises_on_every_rank() -> None:
    with pytest.raises(ValueError, match="root"):
        ms.reduce(torch.ones(2), root=size())
    with pytest.raises(ValueError, match="op='max' is not supported by reduce; use allreduce for max and min"):
        ms.reduce(torch.ones(2), op="max")


# ---------------------------------------------------------------------------------------------------------------
# reduce_scatter / reduce_scatter_v


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_reduce_scatter_forward_and_adjoint(op: str, dim: int) -> None:
    shape = (2 * size(), 3) if dim == 0 else (3, 2 * size())
    x = strided(shape, seed=12)
    out = ms.reduce_scatter(x, dim=dim, op=op)
    total = _stacked(x).sum(0) / (size() if op == "avg" else 1)
    _assert_close(out, torch.chunk(total, size(), dim=dim)[rank()])
    assert_adjoint(lambda t: ms.reduce_scatter(t, dim=dim, op=op), x, seed=12)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("pattern", ["r+1", "r (rank 0 empty)", "default"])
def test_reduce_scatter_v_uneven(dim: int, pattern: str) -> None:
    sizes = {
        "r+1": [r + 1 for r in range(size())],
        "r (rank 0 empty)": list(range(size())),
        "default": None,
    }[pattern]
    length = sum(sizes) if sizes is not None else 2 * size() + 1
    expected_sizes = sizes or [t.shape[0] for t in torch.tensor_split(torch.empty(length), size())]
    x = strided((length, 3) if dim == 0 else (3, length), seed=13)
    out = ms.reduce_scatter_v(x, sizes, dim=dim)
    _assert_close(out, torch.split(_stacked(x).sum(0), expected_sizes, dim=dim)[rank()])
    assert_adjoint(lambda t: ms.reduce_scatter_v(t, sizes, dim=dim), x, seed=13)


def test_reduce_scatter_errors_raise_on_every_rank() -> None:
    if size() > 1:
        with pytest.raises(ValueError, match="not divisible"):
            ms.reduce_scatter(torch.ones(size() + 1))
    with pytest.raises(ValueError, match="sizes"):
        ms.reduce_scatter_v(torch.ones(3), [1] * (size() + 1))
    for scatter in (ms.reduce_scatter, ms.reduce_scatter_v):  # a 0-d tensor has no dimension to split, at 1 rank too
        with pytest.raises(ValueError, match=r"0-dimensional tensor; use tensor.reshape\(1\)"):
            scatter(torch.tensor(2.0))


# ---------------------------------------------------------------------------------------------------------------
# prod, logical and bitwise ops on every reduction

VARIANTS = ["allreduce", "iallreduce", "reduce", "reduce_scatter"]


def _reduced(variant: str, tensor: torch.Tensor, op: str) -> torch.Tensor | Placeholder:
    """``tensor`` reduced with ``op`` by ``variant`` (reduce: to the last rank; reduce_scatter: along dim 0)."""
    if variant == "allreduce":
        return ms.allreduce(tensor, op)
    if variant == "iallreduce":
        return ms.iallreduce(tensor, op).wait()
    if variant == "reduce":
        return ms.reduce(tensor, root=size() - 1, op=op)
    return ms.reduce_scatter(tensor, op=op)


def _mine(variant: str, total: torch.Tensor) -> torch.Tensor | None:
    """What ``variant`` gives this rank of the reduction ``total`` over ranks (``None``: a Placeholder)."""
    if variant == "reduce":
        return total if rank() == size() - 1 else None
    return total.chunk(size())[rank()] if variant == "reduce_scatter" else total


def _placed(variant: str, cotangent: torch.Tensor | None, total: torch.Tensor) -> torch.Tensor:
    """This rank's cotangent placed where its output sits in ``total`` (zero elsewhere)."""
    full = torch.zeros_like(total)
    if cotangent is not None:
        _mine(variant, full).copy_(cotangent)
    return full


def _with_zeros(seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Random per-rank (2P, 3) values with zeros: [0, 0] on rank 0 only, [0, 1] on the first and the last rank,
    [0, 2] on every rank."""
    x = torch.randn((2 * size(), 3), dtype=dtype, generator=rank_generator(seed))
    x[0, 0] *= rank() != 0
    x[0, 1] *= rank() not in (0, size() - 1)
    x[0, 2] = 0
    return x


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
def test_prod_with_zeros_matches_torch(variant: str, dtype: torch.dtype) -> None:
    """Value and gradient against torch.prod over every rank's input in one process (its backward handles zeros),
    with a random cotangent per rank; complex inputs follow torch's conjugate convention."""
    x = _with_zeros(seed=20, dtype=dtype).requires_grad_(True)
    out = _reduced(variant, x, "prod")
    inputs = _stacked(x.detach()).requires_grad_(True)
    total = inputs.prod(0)
    expected = _mine(variant, total.detach())
    cotangent = None
    if expected is None:
        assert isinstance(out, Placeholder)
        out.backward()
    else:
        _assert_close(out.detach(), expected)
        cotangent = torch.randn(out.shape, dtype=dtype, generator=rank_generator(21))
        out.backward(cotangent)
    total.backward(torch.stack(gather_reference(_placed(variant, cotangent, total))).sum(0))
    _assert_close(x.grad, inputs.grad[rank()])


@pytest.mark.parametrize("variant", VARIANTS)
def test_prod_adjoint(variant: str) -> None:
    """The dot-product test for the linearisation J of the product at x (zeros included). The product is linear in
    each rank's input, so J v = sum_r (the product with rank r's input replaced by v_r): P forward calls. Then
    sum_ranks <J v, y> must equal sum_ranks <v, J^T y>, J^T y being what backward computes."""
    x, v = _with_zeros(seed=22), random_like_rank((2 * size(), 3), seed=23)
    with torch.no_grad():
        parts = [_reduced(variant, v if rank() == r else x, "prod") for r in range(size())]
    x.requires_grad_(True)
    out = _reduced(variant, x, "prod")
    lhs = 0.0
    if isinstance(out, Placeholder):
        out.backward()
    else:
        y = random_like_rank(tuple(out.shape), seed=24)
        lhs = float((sum(parts) * y).sum())
        out.backward(y)
    lhs, rhs = COMM.allreduce(lhs), COMM.allreduce(float((v * x.grad).sum()))
    assert math.isclose(lhs, rhs, rel_tol=1e-10, abs_tol=1e-12), (lhs, rhs)


LOGICAL_AND_BITWISE = {
    "land": torch.logical_and,
    "lor": torch.logical_or,
    "lxor": torch.logical_xor,
    "band": torch.bitwise_and,
    "bor": torch.bitwise_or,
    "bxor": torch.bitwise_xor,
}


@pytest.mark.parametrize("op", list(LOGICAL_AND_BITWISE))
def test_logical_and_bitwise_ops_match_torch(op: str) -> None:
    """Every variant and integer or bool dtype against torch's op folded over every rank's input in one process. A
    logical op of integers gives 1 or 0 in their dtype (at one rank too). No gradient path: these dtypes cannot
    require grad."""
    for dtype in (torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64):
        low = 0 if dtype == torch.bool else -3
        x = torch.randint(low, 4, (2 * size(), 3), generator=rank_generator(25)).to(dtype)
        inputs = _stacked(x)
        operands = (inputs != 0) if op.startswith("l") else inputs
        total = functools.reduce(LOGICAL_AND_BITWISE[op], operands.unbind(0)).to(dtype)
        for variant in VARIANTS:
            out = _reduced(variant, x, op)
            expected = _mine(variant, total)
            if expected is None:
                assert isinstance(out, Placeholder) and not out.requires_grad
            else:
                assert out.dtype == dtype and not out.requires_grad and torch.equal(out, expected), (variant, dtype)
    in_place = x.clone()
    assert ms.iallreduce(in_place, op, out=in_place).wait() is in_place and torch.equal(in_place, total)


_BITS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def _nan(bits: int) -> float:
    """The float64 NaN with bit pattern ``bits`` (sign and payload chosen by the caller)."""
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def _nan_and_zero_ties(dtype: torch.dtype) -> torch.Tensor:
    """Per-rank values where MPI_MAX/MPI_MIN depend on the order of combining: a NaN on rank 0 only, on the last
    rank only, on every rank (payload and sign differing per rank), -0.0 or +0.0 by the parity of the rank."""
    r, last = rank(), size() - 1
    values = [
        float("nan") if r == 0 else 1.0 + r,
        float("nan") if r == last else -1.0 - r,
        _nan(0x7FF8000000000000 + (r << 40) + (r % 2 << 63)),
        -0.0 if r % 2 == 0 else 0.0,
        float(r),
    ]
    return torch.tensor(values, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("dtype", list(_BITS), ids=str)
@pytest.mark.parametrize("op", ["max", "min"])
def test_allreduce_max_min_propagate_nan_with_the_same_bits_on_every_rank(op: str, dtype: torch.dtype) -> None:
    out = ms.allreduce(_nan_and_zero_ties(dtype), op)
    bits = gather_reference(out.view(_BITS[dtype]))
    assert all(torch.equal(b, bits[0]) for b in bits), f"ranks differ: {[b.tolist() for b in bits]}"
    inputs = _stacked(_nan_and_zero_ties(dtype))
    expected = inputs.amax(0) if op == "max" else inputs.amin(0)  # NaN-propagating, as with one rank
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    zero_sign = 1.0 if (op == "max" and size() > 1) else -1.0  # -0.0 < +0.0; rank 0 alone holds -0.0
    assert math.copysign(1.0, float(out[3])) == zero_sign


@pytest.mark.parametrize("op", ["max", "min"])
def test_allreduce_max_min_gradient_of_a_nan_goes_to_the_lowest_rank_holding_one(op: str) -> None:
    x = _nan_and_zero_ties(torch.float64).requires_grad_(True)
    y = random_like_rank((5,), seed=5)
    ms.allreduce(x, op).backward(y)
    inputs, cotangents = _stacked(x.detach()), _stacked(y)
    extreme = inputs.amax(0) if op == "max" else inputs.amin(0)
    holds = (inputs == extreme) | (inputs.isnan() & extreme.isnan())
    owner = holds.int().argmax(0)  # the lowest rank holding the extremum, or a NaN where the result is NaN
    expected = torch.where(owner == rank(), cotangents.sum(0), torch.zeros(5, dtype=torch.float64))
    _assert_close(x.grad, expected)
    # The dot-product test of the linearisation: J v takes each element from its owner's tangent v_owner.
    v = random_like_rank((5,), seed=6)
    tangent = _stacked(v).gather(0, owner.unsqueeze(0)).squeeze(0)
    lhs = float((cotangents.sum(0) * tangent).sum())
    rhs = COMM.allreduce(float((x.grad * v).sum()))
    assert math.isclose(lhs, rhs, rel_tol=1e-12, abs_tol=1e-12)
